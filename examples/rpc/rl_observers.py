"""Reinforcement learning with one agent and several observers (PyTorch's RPC tutorial, in small).

The agent owns the policy. Each observer runs episodes of a toy environment (reward 1
when the action matches the sign of the state's first feature) and asks the agent for
every action over RPC; the agent records log-probabilities and rewards per observer,
then runs a REINFORCE update after each round of episodes.

    python examples/rpc/rl_observers.py
"""

import torch

import torchdist.rpc as rpc

from _launch import spawn

NUM_OBSERVERS = 3
EPISODE_STEPS = 10
ROUNDS = 30


class Observer:
    def __init__(self, seed):
        self.gen = torch.Generator().manual_seed(seed)

    def run_episode(self, agent_rref, observer_id):
        total = 0.0
        for _ in range(EPISODE_STEPS):
            state = torch.randn(4, generator=self.gen)
            action = agent_rref.rpc_sync().select_action(observer_id, state)
            reward = 1.0 if action == int(state[0] > 0) else 0.0
            agent_rref.rpc_sync().report_reward(observer_id, reward)
            total += reward
        return total


class Agent:
    def __init__(self, world_size):
        torch.manual_seed(0)
        self.policy = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=0.05)
        self.me = rpc.RRef(self)
        self.observers = {r: rpc.remote(f"observer{r}", Observer, args=(r,)) for r in range(1, world_size)}
        self.log_probs = {r: [] for r in self.observers}
        self.rewards = {r: [] for r in self.observers}

    def select_action(self, observer_id, state):
        dist = torch.distributions.Categorical(logits=self.policy(state))
        action = dist.sample()
        self.log_probs[observer_id].append(dist.log_prob(action))
        return action.item()

    def report_reward(self, observer_id, reward):
        self.rewards[observer_id].append(reward)

    def run_round(self):
        futures = [obs.rpc_async().run_episode(self.me, r) for r, obs in self.observers.items()]
        mean_reward = sum(torch.futures.wait_all(futures)) / len(futures)
        loss = 0.0
        for r in self.observers:
            returns = torch.tensor(self.rewards[r]) - 0.5
            loss = loss - (torch.stack(self.log_probs[r]) * returns).sum()
            self.log_probs[r], self.rewards[r] = [], []
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return mean_reward


def run(rank, world_size):
    rpc.init_rpc("agent" if rank == 0 else f"observer{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        agent = Agent(world_size)
        rewards = [agent.run_round() for _ in range(ROUNDS)]
        early, late = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        print(f"agent: mean reward per episode {early:.1f} -> {late:.1f} (max {EPISODE_STEPS})")
        assert late > early, "the policy did not improve"
        print("rl observers: OK")
    rpc.shutdown()


if __name__ == "__main__":
    spawn(run, NUM_OBSERVERS + 1)
