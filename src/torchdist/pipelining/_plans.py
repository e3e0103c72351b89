"""The order in which each rank runs forward and backward of its microbatches: one list of actions per rank.

An action is (stage, F | B | I | W, microbatch): F forward, B full backward, I
the input-gradient half of a backward and W its weight-gradient half (zero
bubble, arXiv:2401.10241). Communication is not part of a plan: a plan is
compute only, and ``_actions.add_send_recv`` lowers it into one with explicit
SEND/RECV actions (the enum holds those and the FSDP actions too). A plan is
correct when the ranks can run it together without waiting on each other in a
cycle, which ``simulate`` checks.

With S stages, P ranks and M microbatches (one stage per rank: S == P):

* GPipe (arXiv:1811.06965): all M forwards, then all M backwards.
* 1F1B (PipeDream-flush, arXiv:2006.09503): stage s runs min(M, S - s)
  forwards, then alternates one backward and one forward, then drains the
  backwards; at most S - s microbatches are in flight on stage s.
* Interleaved 1F1B (Megatron-LM, arXiv:2104.04473): V = S / P stages per rank
  (stage s on rank s % P); forwards walk the local stages in rounds of
  ``microbatches_per_round`` microbatches, depth first; warmup of
  (V - 1) * per_round + 2 * (P - 1 - rank) forwards, then 1F1B.
* Looped BFS (arXiv:2211.05953): every forward of local stage 0, then of local
  stage 1, ...; then the backwards in reverse.
* Interleaved zero bubble: found by simulating the pipeline in unit time
  steps; each rank picks I first, then F while fewer than a cap of
  microbatches are in flight, then W.
* ZBV (arXiv:2401.10241, section 6): the stages placed as a V (rank r holds
  stages r and 2P - 1 - r) and PyTorch 2.13's fixed order, see ``zbv``.
* DualPipeV (DeepSeek-V3, arXiv:2412.19437, folded into a V): the same V
  placement; in steady state a rank pairs the forward of one of its stages
  with the full backward of the other in one OVERLAP_F_B action, so that one
  computes while the other communicates. Eight phases, see ``dualpipe_v``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from enum import Enum
from typing import Callable, NamedTuple

__all__ = ["_ComputationType", "_Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "looped_bfs",
           "zero_bubble", "zbv", "dualpipe_v", "stage_to_rank", "simulate", "compute_actions"]


class _ComputationType(str, Enum):
    """What an action does. Compute: F, B, I, W, OVERLAP_F_B. Communication (the lowered form, see ``_actions``):
    SEND_F/RECV_F move a microbatch's activations from stage s to s + 1, SEND_B/RECV_B its gradients from s to
    s - 1. FSDP: UNSHARD gathers a stage's parameters, RESHARD frees them; REDUCE_GRAD scales (and, for a sharded
    or replicated stage, reduces) a stage's gradients once its last backward has run."""

    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FULL_BACKWARD = "B"
    OVERLAP_F_B = "OVERLAP_F_B"  # a forward and a backward of two stages of one rank, run together
    REDUCE_GRAD = "REDUCE_GRAD"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def from_str(action: str) -> _ComputationType:
        try:
            return _ComputationType(action)
        except ValueError as exc:
            raise RuntimeError(f"Invalid computation type {action}") from exc


F, B, I, W = (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT,
              _ComputationType.BACKWARD_WEIGHT)
OVERLAP_F_B = _ComputationType.OVERLAP_F_B
SEND_F, RECV_F, SEND_B, RECV_B = (_ComputationType.SEND_F, _ComputationType.RECV_F, _ComputationType.SEND_B,
                                  _ComputationType.RECV_B)
UNSHARD, RESHARD, REDUCE_GRAD = _ComputationType.UNSHARD, _ComputationType.RESHARD, _ComputationType.REDUCE_GRAD
_COMPUTE = frozenset((F, B, I, W, OVERLAP_F_B))
# one action as text: stage, kind, optional microbatch (the longer kinds first, so that "SEND_F" is not read as "S")
_ACTION_RE = re.compile(r"(\d+)(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B|F|I|B|W)(\d*)")


class _Action(NamedTuple):
    """``2F0``: stage 2, forward, microbatch 0; ``1SEND_F3``, ``0UNSHARD`` (no microbatch). An OVERLAP_F_B holds its
    forward and backward in ``sub_actions`` (stage -1 and microbatch None, as in PyTorch) and prints as
    ``(2F0;1B3)OVERLAP_F_B``. ``from_str`` reads what ``repr`` writes; an empty string is no action (None)."""

    stage_index: int
    computation_type: _ComputationType
    microbatch_index: int | None = None
    sub_actions: tuple[_Action, ...] | None = None

    def __repr__(self) -> str:
        if self.sub_actions is not None:
            return f"({';'.join(map(repr, self.sub_actions))}){self.computation_type}"
        microbatch = "" if self.microbatch_index is None else self.microbatch_index
        return f"{self.stage_index}{self.computation_type}{microbatch}"

    __str__ = __repr__

    @property
    def key(self) -> tuple:
        """(stage, kind, microbatch): what the plan functions and the simulator track as done."""
        return (self.stage_index, self.computation_type, self.microbatch_index)

    @property
    def is_compute_op(self) -> bool:
        return self.computation_type in _COMPUTE

    @staticmethod
    def from_str(action_string: str) -> _Action | None:
        text = action_string.strip()
        if not text:
            return None
        if text.startswith("(") and ")" in text:
            inner, kind = text[1:text.index(")")], text[text.index(")") + 1:]
            subs = tuple(a for a in (_Action.from_str(part) for part in inner.split(";")) if a is not None)
            return _Action(-1, _ComputationType.from_str(kind), None, subs or None)
        match = _ACTION_RE.match(text)  # like PyTorch: a valid prefix is enough ("1F0x" reads as 1F0)
        if match is None:
            raise RuntimeError(f"Invalid action string: {text}, should be formatted as "
                               "[stage][action type][(microbatch)] e.g. 2F0")
        stage, kind, microbatch = match.groups()
        return _Action(int(stage), _ComputationType.from_str(kind), int(microbatch) if microbatch else None)


def compute_actions(actions: list[_Action]) -> list[_Action]:
    """``actions`` with every OVERLAP_F_B replaced by its sub-actions, forward first (how a CPU runs it)."""
    return [sub for a in actions for sub in (a.sub_actions if a.sub_actions is not None else (a,))]


def stage_to_rank(pp_size: int, num_stages: int, style: str = "loop") -> dict[int, int]:
    """Which group rank holds each stage: ``loop`` (s % P) or ``v`` (down the ranks, then back up)."""
    if style == "loop":
        return {s: s % pp_size for s in range(num_stages)}
    if style == "v":
        if num_stages % pp_size:
            raise ValueError(
                f"num_stages {num_stages} must be evenly divisible by pp_size {pp_size} for V schedules"
            )
        return {s: (s % pp_size if (s // pp_size) % 2 == 0 else pp_size - 1 - s % pp_size)
                for s in range(num_stages)}
    raise ValueError(f"Style {style} is not supported.")


def gpipe(stage: int, n_mb: int) -> list[_Action]:
    return [_Action(stage, F, m) for m in range(n_mb)] + [_Action(stage, B, m) for m in range(n_mb)]


def one_f_one_b(stage: int, num_stages: int, n_mb: int) -> list[_Action]:
    warmup = min(n_mb, num_stages - stage)
    actions = [_Action(stage, F, m) for m in range(warmup)]
    for m in range(n_mb):
        actions.append(_Action(stage, B, m))
        if warmup + m < n_mb:
            actions.append(_Action(stage, F, warmup + m))
    return actions


def looped_bfs(rank: int, pp_size: int, n_local: int, n_mb: int) -> list[_Action]:
    stages = [rank + i * pp_size for i in range(n_local)]
    forwards = [_Action(s, F, m) for s in stages for m in range(n_mb)]
    return forwards + [_Action(s, B, m) for s in reversed(stages) for m in reversed(range(n_mb))]


def interleaved_1f1b(rank: int, pp_size: int, n_local: int, n_mb: int, per_round: int) -> list[_Action]:
    """Megatron's interleaved order for one rank (see the module docstring)."""
    total = n_local * n_mb
    warmup = min((n_local - 1) * per_round + 2 * (pp_size - 1 - rank), total)

    def nth(k: int, backward: bool) -> tuple[int, int]:
        local = (k // per_round) % n_local
        if backward:
            local = n_local - 1 - local
        microbatch = (k // (per_round * n_local)) * per_round + k % per_round
        return rank + local * pp_size, microbatch

    actions = [_Action(s, F, m) for s, m in (nth(k, False) for k in range(warmup))]
    for k in range(total):
        if warmup + k < total:
            stage, m = nth(warmup + k, False)
            actions.append(_Action(stage, F, m))
        stage, m = nth(k, True)
        actions.append(_Action(stage, B, m))
    return actions


def zero_bubble(num_stages: int, pp_size: int, n_mb: int, placement: dict[int, int],
                in_flight: Callable[[int], int]) -> dict[int, list[_Action]]:
    """Every rank's order of F, I and W, from a unit-time simulation (see the module docstring).

    ``in_flight(rank)`` caps the microbatches a rank holds activations for (forwarded, W not yet run)."""
    local = defaultdict(list)
    for s, r in placement.items():
        local[r].append(s)
    done: set[tuple[int, _ComputationType, int]] = set()
    plans: dict[int, list[_Action]] = {r: [] for r in range(pp_size)}
    pending_w: dict[int, list[_Action]] = {r: [] for r in range(pp_size)}
    held = defaultdict(int)
    total = num_stages * n_mb * 3
    while len(done) < total:
        step: list[_Action] = []
        for r in range(pp_size):
            choice = _pick(r, local[r], num_stages, n_mb, done, held[r] < in_flight(r), pending_w[r])
            if choice is not None:
                step.append(choice)
        if not step:
            raise RuntimeError("zero bubble plan: no rank can make progress (this is a bug in the plan)")
        for action in step:
            r = placement[action.stage_index]
            plans[r].append(action)
            done.add(action.key)
            if action.computation_type is F:
                held[r] += 1
            elif action.computation_type is I:
                pending_w[r].append(_Action(action.stage_index, W, action.microbatch_index))
            else:
                pending_w[r].remove(action)
                held[r] -= 1
    return plans


def _pick(rank: int, stages: list[int], num_stages: int, n_mb: int, done: set, may_forward: bool,
          pending_w: list[_Action]) -> _Action | None:
    """The next action of ``rank``: the earliest ready I (later stages first), else a ready F, else a W."""
    for s in sorted(stages, reverse=True):
        for m in range(n_mb):
            if (s, I, m) in done or (s, F, m) not in done:
                continue
            if s == num_stages - 1 or (s + 1, I, m) in done:
                return _Action(s, I, m)
            break  # microbatches run in order on a stage
    if may_forward:
        for s in sorted(stages, reverse=True):
            for m in range(n_mb):
                if (s, F, m) in done:
                    continue
                if s == 0 or (s - 1, F, m) in done:
                    return _Action(s, F, m)
                break
    return pending_w[0] if pending_w else None


def zbv(rank: int, pp_size: int, n_mb: int) -> list[_Action]:
    """PyTorch 2.13's ZBV order for one rank: stage ``down = r`` and ``up = 2P - 1 - r``. Phases, with repeats:

    1. F down                          2 (P - r) - 1
    2. F up, F down                    r
    3. F up, I up, W up                P - r
    4. F down, I W down, F up, I W up  until every forward ran (the F down only while microbatches are left)
    5. I down, I up                    r
    6. I down, W down                  P - r
    7. the pending W up, then the pending W down

    It is planned for at least 2P - 1 microbatches; actions of the microbatches beyond ``n_mb`` are dropped."""
    down, up = rank, 2 * pp_size - 1 - rank
    n_plan = max(2 * pp_size - 1, n_mb)
    count = defaultdict(int)  # (stage, kind) -> next microbatch
    actions: list[_Action] = []

    def add(stage: int, kind: _ComputationType) -> None:
        actions.append(_Action(stage, kind, count[stage, kind]))
        count[stage, kind] += 1

    for _ in range(2 * (pp_size - rank) - 1):
        add(down, F)
    for _ in range(rank):
        add(up, F)
        add(down, F)
    for _ in range(pp_size - rank):
        add(up, F), add(up, I), add(up, W)
    while count[up, F] < count[down, F] or count[down, F] < n_plan:
        if count[down, F] < n_plan:
            add(down, F)
        add(down, I), add(down, W)
        add(up, F), add(up, I), add(up, W)
    for _ in range(rank):
        add(down, I), add(up, I)
    for _ in range(pp_size - rank):
        add(down, I), add(down, W)
    for stage in (up, down):
        while count[stage, W] < count[stage, I]:
            add(stage, W)
    return [a for a in actions if a.microbatch_index < n_mb]


class _RankPlan:
    """One rank's plan being written: numbers each stage's forwards and backwards in order, queues pending Ws."""

    def __init__(self) -> None:
        self.actions: list[_Action] = []
        self._forwards: dict[int, int] = defaultdict(int)
        self._backwards: dict[int, int] = defaultdict(int)  # B and I share the count: each is one microbatch's
        self._pending_w: list[_Action] = []

    def forward(self, stage: int) -> _Action:
        action = _Action(stage, F, self._forwards[stage])
        self._forwards[stage] += 1
        return action

    def backward(self, stage: int, split: bool = False) -> _Action:
        """The next backward of ``stage``: full (B), or input gradients only (I) with its W queued."""
        action = _Action(stage, I if split else B, self._backwards[stage])
        self._backwards[stage] += 1
        if split:
            self._pending_w.append(_Action(stage, W, action.microbatch_index))
        return action

    def add(self, *actions: _Action) -> None:
        self.actions.extend(actions)

    def add_overlap(self, forward_stage: int, backward_stage: int) -> None:
        self.add(_Action(-1, OVERLAP_F_B, None, (self.forward(forward_stage), self.backward(backward_stage))))

    def add_weight(self) -> None:
        """The oldest pending W, if any (a W fills a slot where the rank would otherwise wait)."""
        if self._pending_w:
            self.add(self._pending_w.pop(0))


def dualpipe_v(rank: int, pp_size: int, n_mb: int) -> list[_Action]:
    """PyTorch 2.13's DualPipeV order for one rank (needs n_mb >= 2 * pp_size).

    Rank r holds stage ``down = r`` (the V's first leg) and ``up = 2P - 1 - r`` (the second leg). The phases,
    with the number of times each repeats:

    1. F down                                 2 (P - r - 1)   fill the first leg
    2. F down, F up                           r + 1           the V's turn reaches this rank
    3. I up, W, F up                          P - r - 1       first backwards, zero-bubble style
    4. (F down; B up), (F up; B down)         M - 2P + r + 1  steady state, two overlaps per round
                                                              (the last rank does not overlap its very first pair)
    5. B up, (F up; B down)                   P - r - 1       forwards run out
    6. B up, B down                           r + 1           from the middle on, I instead of B
    7. W, I down                              P - r - 1
    8. W                                      r + 1           drain the pending weight gradients
    """
    down, up = rank, 2 * pp_size - 1 - rank
    plan = _RankPlan()
    for _ in range(2 * (pp_size - rank - 1)):
        plan.add(plan.forward(down))
    for _ in range(rank + 1):
        plan.add(plan.forward(down), plan.forward(up))
    for _ in range(pp_size - rank - 1):
        plan.add(plan.backward(up, split=True))
        plan.add_weight()
        plan.add(plan.forward(up))
    for i in range(n_mb - 2 * pp_size + rank + 1):
        if i == 0 and rank == pp_size - 1:  # not overlapped: PyTorch found this shortens the bubble
            plan.add(plan.forward(down), plan.backward(up))
        else:
            plan.add_overlap(down, up)
        plan.add_overlap(up, down)
    for _ in range(pp_size - rank - 1):
        plan.add(plan.backward(up))
        plan.add_overlap(up, down)
    half = (rank + 1) // 2  # from this round on, backwards are split into I and W
    for i in range(rank + 1):
        # odd ranks split both backwards of the middle round, even ranks only the second
        plan.add(plan.backward(up, split=i > half or (i == half and rank % 2 == 1)))
        plan.add(plan.backward(down, split=i >= half))
    for _ in range(pp_size - rank - 1):
        plan.add_weight()
        plan.add(plan.backward(down, split=True))
    for _ in range(rank + 1):
        plan.add_weight()
    return plan.actions


def simulate(plans: dict[int, list[_Action]], placement: dict[int, int], num_stages: int) -> int:
    """Run the ranks' plans together (a rank waits for what its next action needs); return the steps taken.
    Raises RuntimeError if they deadlock or a plan breaks a dependency.

    An OVERLAP_F_B runs in one step once both its forward and its backward could start, as on a GPU where
    the two run at once; a CPU runs the forward first, which never needs more than that."""
    done: set[tuple] = set()
    position = {r: 0 for r in plans}

    def ready_one(a: _Action) -> bool:
        s, kind, m = a.key
        if kind is F:
            return s == 0 or (s - 1, F, m) in done
        if kind in (B, I):
            after = (s + 1, B, m) in done or (s + 1, I, m) in done
            return (s, F, m) in done and (s == num_stages - 1 or after)
        return (s, I, m) in done

    def ready(a: _Action) -> bool:
        return all(ready_one(sub) for sub in compute_actions([a]))

    steps = 0
    while any(position[r] < len(plans[r]) for r in plans):
        nexts = {r: plans[r][position[r]] for r in plans if position[r] < len(plans[r])}
        runnable = {r: a for r, a in nexts.items() if ready(a)}
        if not runnable:
            raise RuntimeError(f"pipeline plan deadlocks: every rank waits, next actions {nexts}")
        for r, a in runnable.items():
            for sub in compute_actions([a]):
                if placement[sub.stage_index] != r:
                    raise RuntimeError(f"pipeline plan of rank {r} holds {sub}, but stage {sub.stage_index} is on "
                                       f"rank {placement[sub.stage_index]}")
                done.add(sub.key)
            position[r] += 1
        steps += 1
    return steps
