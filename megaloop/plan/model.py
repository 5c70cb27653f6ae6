"""What a plan is: per rank, the tensors and buffers of one arena, the ops with their tile
parameters, the tile tasks with what they read and write, the counters, and each processor's
ordered task list. ``docs/plan-format.md`` describes the JSON form of the same objects.

Counting conventions: strides and tensor offsets in elements; buffer offsets and sizes in bytes
from the start of the rank's arena. A task increments its ``signal`` counter once per iteration
after it ran; a ``Wait(rank, counter, lag)`` in iteration k blocks until that counter (on ``rank``)
reaches ``signalers(counter) * (k + 1 - lag)``: lag 0 waits for this iteration's work, lag 1 for the
previous iteration's (write-after-read across iterations). Targets grow with k, so counters are
never reset. All signalers of a counter run on one processor, which makes the count exact: it can
only reach n·m once every signaler has finished iterations 0..m-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, NamedTuple

from megaloop.dtypes import DType
from megaloop.frontend.graph import Graph
from megaloop.frontend.tiling import Box
from megaloop.fuse.options import FuseOptions

# What Plan's conveniences call (save, load: megaloop.plan.format; verify: verify_plan; stats:
# plan_stats). Those modules build on this one, so megaloop/plan/__init__.py hands them over.
CONVENIENCES = SimpleNamespace()

FORMAT = "megaloop-plan"
VERSION = 5  # 2: "options" (KernelOptions); 3: the weight ring's options; 4: "fusion" (FuseOptions);
# 5: "name" and "others" (the further programs of one loop kernel: megaloop/plan/programs.py)

# buffer kinds: read-only while a run is in flight (written by the host between runs) ...
READ_ONLY_KINDS = ("parameter", "constant", "input")
# ... or written by tasks
WRITABLE_KINDS = ("state", "output", "scratch")
BUFFER_KINDS = READ_ONLY_KINDS + WRITABLE_KINDS


@dataclass
class PlanTensor:
    id: int
    name: str
    dtype: DType
    shape: tuple[int, ...]
    buffer: int  # the buffer holding its storage
    strides: tuple[int, ...]  # elements
    offset: int  # elements from the buffer's start


@dataclass
class Buffer:
    id: int
    name: str
    kind: str  # one of BUFFER_KINDS
    offset: int  # bytes from the arena's start (aligned)
    nbytes: int
    shape: tuple[int, ...] = ()  # the storage's own (row-major) shape: what views' strides refer to
    peer: bool = False  # read by tasks of other ranks: must live in peer-visible memory


@dataclass
class PlanOp:
    id: int
    name: str  # the graph node's name, or for a plan-made copy "assign:<state>", "stage:<state>", "output:<name>"
    op: str  # registry name
    node: int | None  # graph node id (None for plan-made copies)
    inputs: list[int]  # tensor ids
    outputs: list[int]
    attrs: dict[str, Any]
    tile: dict[str, int]  # tiling parameters
    seq: int  # position in the program's sequential order (across ranks)


class Access(NamedTuple):
    tensor: int  # tensor id in the plan of ``rank``
    box: Box
    rank: int  # whose tensor: this rank's, or a peer's for collectives


class Wait(NamedTuple):
    rank: int
    counter: int
    lag: int


@dataclass
class Task:
    id: int
    op: int  # PlanOp id
    coords: tuple[int, ...]
    reads: list[Access]
    writes: list[Access]
    flops: int
    bytes: int
    cost_ns: float
    signal: int = -1  # counter id on this rank
    waits: list[Wait] = field(default_factory=list)


@dataclass
class Counter:
    id: int
    name: str


@dataclass
class RankPlan:
    rank: int
    graph: Graph
    tensors: list[PlanTensor]
    buffers: list[Buffer]
    ops: list[PlanOp]
    tasks: list[Task]
    counters: list[Counter]
    processors: list[list[int]]  # task ids in execution order, one list per processor
    arena_bytes: int
    # derived while planning or loading, not saved:
    tensor_of: dict[Any, int] = field(default_factory=dict)  # graph Tensor -> tensor id
    owner: dict[int, int] = field(default_factory=dict)  # tensor id -> tensor id owning its storage
    outputs: dict[str, int] = field(default_factory=dict)  # output name -> the tensor the host reads
    memory: Any = None  # megaloop.plan.memory.Layout of the arena

    def is_parameter(self, tensor: int) -> bool:
        """Whether tensor ``tensor`` lives in a parameter buffer (weights: nothing writes them)."""
        return self.buffers[self.tensors[tensor].buffer].kind == "parameter"

    def task_name(self, task: Task) -> str:
        coords = ",".join(str(c) for c in task.coords)
        return f"{self.ops[task.op].name}[{coords}]"

    def signalers(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for t in self.tasks:
            out.setdefault(t.signal, []).append(t.id)
        return out


# what a plan file without the field was built with: the defaults before they changed (the others'
# defaults are what their kernels had before the field existed)
ABSENT_OPTIONS = {"weight_ring_slots": 8, "weight_ring_loader": 0, "decode_attention": 0, "poll_sleep_ns": 256}


@dataclass(frozen=True)
class KernelOptions:
    """How the loop kernel is built beyond each op's tile parameters; saved in the plan as "options",
    so a plan file says how its kernel was built. Experiments pass these; nothing else switches code."""

    # waits warp 1 copies into a task's slot ahead (the rest are read when it waits); above 16 the
    # kernel's static shared memory grows past the 8 KB that wgmma and attention tiles leave it
    slot_waits: int = 16
    # the longest sleep between two polls of a wait's counters (0: none, polls back to back: a sleep
    # adds its remainder to every handoff of a decode step's chain)
    poll_sleep_ns: int = 0
    # shared-memory slots of the weight ring (megaloop/ring.cuh) that streams decode matmuls' weights
    # ahead of their waits on sm_90 (0: off), and the bytes of one slot (whole weight rows each)
    # (the most slots: as many as fit beside the kernel's tiles)
    weight_ring_slots: int = 12
    weight_ring_slot_bytes: int = 16384
    # a ninth warp a block issues the ring's copies across tasks, waits and iterations, at most
    # weight_ring_loader_bytes not yet landed (megaloop/ring_loader.cuh): 1 strictly in order, 2 the
    # oldest chunk whose slot is free; 0: the tiles do (at most 32 slots with it; one program a kernel)
    weight_ring_loader: int = 2
    weight_ring_loader_bytes: int = 49152
    # the loop's own cost (docs/runtime.md, "The loop's own cost"): 1 stamps each block's grant, doorbell
    # read (with the host's clock read in it) and completion (LoopKernel.grant_ns); 0 compiles none of it
    round_trip_stamps: int = 0
    # 1: a task's slot is one record per list position (task, waits, operand offsets), copied by
    # cp.async two tasks ahead; 0: warp 1 gathers it one task ahead (three dependent loads)
    task_records: int = 0
    # 1: the last block to finish a grant writes one completion word the host spins on; 0: every
    # block writes its progress at a grant's end and the host takes their minimum
    completion_word: int = 0
    # block 0's doorbell poll: 0 an L2 check of the abort flag and of the grant around every PCIe read;
    # n: n reads in flight at once, spaced over one read's trip, the abort flag every 8th round
    doorbell_reads: int = 0
    # decode attention tiles (queries too few for tensor cores): 0 split keys (a head's dims over a few
    # lanes, keys over warps); 1 lanes over keys, built for latency (megaloop/attention_lanes.cuh; the
    # paged pools' too, their keys staged through the page table: megaloop/paged.cuh)
    decode_attention: int = 1

    def check(self, error: type, where: str) -> None:
        """Raise ``error`` naming the field unless every field is in range."""
        limits = (
            ("slot_waits", self.slot_waits, 1, 128),
            ("poll_sleep_ns", self.poll_sleep_ns, 0, 1 << 20),
            ("weight_ring_slots", self.weight_ring_slots, 0, 64),
            ("weight_ring_slot_bytes", self.weight_ring_slot_bytes, 1024, 1 << 16),
            ("weight_ring_loader", self.weight_ring_loader, 0, 2),
            ("weight_ring_loader_bytes", self.weight_ring_loader_bytes, 1024, 1 << 22),
            ("round_trip_stamps", self.round_trip_stamps, 0, 1),
            ("task_records", self.task_records, 0, 1),
            ("completion_word", self.completion_word, 0, 1),
            ("doorbell_reads", self.doorbell_reads, 0, 4),
            ("decode_attention", self.decode_attention, 0, 1),
        )
        for name, value, low, high in limits:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise error(f"{where}.{name}: must be an int in [{low}, {high}], got {value!r}")
        if self.weight_ring_slot_bytes % 16:
            raise error(f"{where}.weight_ring_slot_bytes: must be a multiple of 16, got {self.weight_ring_slot_bytes}")
        if self.weight_ring_loader and self.weight_ring_slots > 32:  # a lane of the loader warp a slot
            raise error(f"{where}.weight_ring_slots: at most 32 with weight_ring_loader, got {self.weight_ring_slots}")


@dataclass
class Plan:
    arch: str
    processors: int
    warps: int  # per processor (thread block)
    shared_memory: int  # bytes per processor
    ranks: list[RankPlan]
    overrides: dict[str, dict[str, int]] = field(default_factory=dict)  # tile overrides it was made with
    estimated_ns: float = 0.0  # the scheduler's estimate of one iteration
    options: KernelOptions = field(default_factory=KernelOptions)
    fusion: FuseOptions = field(default_factory=FuseOptions)  # the rewrites that made the ranks' graphs
    matching: Any = None  # megaloop.parallel.RankMatching of the graphs (derived, not saved)
    name: str = "main"  # the program's name among the kernel's programs
    # further programs over the same states and parameters, one of which a run picks (plan/programs.py)
    others: list[Plan] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def programs(self) -> list[Plan]:
        """Every program of the loop kernel: this plan, then the others (run i picks one)."""
        return [self, *self.others]

    def program(self, which: int | str) -> Plan:
        """A program by index or name (``programs``); KeyError naming the programs there are."""
        for i, p in enumerate(self.programs):
            if which == i or which == p.name:
                return p
        raise KeyError(f"no program {which!r}: the plan's programs are {[p.name for p in self.programs]}")

    def task_label(self, rank: int, task_id: int) -> str:
        rp = self.ranks[rank]
        prefix = f"rank {rank} " if self.world_size > 1 else ""
        return prefix + rp.task_name(rp.tasks[task_id])

    # conveniences over the plan modules, for users (megaloop's own code calls the functions)
    def save(self, path: Any, *, overwrite: bool = True) -> None:
        """Write the plan as JSON (docs/plan-format.md); ``overwrite=False`` keeps an existing file."""
        CONVENIENCES.save(self, path, overwrite=overwrite)

    @staticmethod
    def load(path: Any, *, rederive: bool = False, verify: bool = True) -> Plan:
        """Read a plan file; ``rederive=True`` after editing tile parameters or task orders."""
        return CONVENIENCES.load(path, rederive=rederive, verify=verify)

    def verify(self) -> Any:
        """Check races, deadlocks and structure; raises a PlanError naming the problem."""
        return CONVENIENCES.verify(self)

    def stats(self) -> Any:
        """Per rank: ops, tasks, waits, bytes (megaloop.plan.stats.RankStats)."""
        return CONVENIENCES.stats(self)
