"""A graph prepared once and run many times on the CPU: what ``megaloop generate`` runs without a GPU.

It runs the graph's own ops with ``ml.evaluate``'s semantics (each op's result rounded to its dtype,
the same rounding points), but:

- values stay in their compute form between ops (float tensors as float32 arrays holding values of
  their dtype: megaloop.frontend.ops._fast), and the parameters are converted to it once
  (``ComputeWeights``, shared by the graphs that read them), not on every step;
- an op with a fast implementation (``OpDef.fast``) runs it: BLAS products without copies of their
  weights, states (KV caches) written in place and kept between runs instead of copied;
- the graph is checked and ordered once, when it is prepared; no view layouts are checked per run;
- glibc's heap is padded (pad_the_heap), so the arrays freed between ops are reused, and a run drops
  each value after its last reader;
- what a run needs can be made ahead on the weights' background threads (megaloop.reference.ahead:
  ``ComputeWeights.convert_ahead``, ``FastGraph.prepare_ahead``), each step's first run waiting for
  its own parameters and packing, so a prefill starts before the decode's float32 copies exist;
- with activations="torch" (a prefill), values between ops are torch tensors of their dtype and each
  op runs its ``Fast.torch`` kernel where it has one (megaloop.frontend.ops._torch): within each op's
  accuracy contract, not the reference's bits.

An op without one runs its reference on operands put back into their storage dtypes, so every graph
runs. Exactness: every op's result has the reference's bits, except where an op's ``Fast`` says
``exact=False`` (attention: BLAS products in another order of sums), whose results stay within the
op's accuracy contract. ``ml.evaluate`` stays the definition the tests hold this path to
(tests/test_fast.py).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megaloop.dtypes import bfloat16
from megaloop.errors import DataError, EvaluationError, InternalError
from megaloop.frontend.graph import Graph, Node, require_results
from megaloop.frontend.ops import _torch
from megaloop.frontend.ops._fast import TORCH_MIN_WEIGHT, Kernel, Weight, compute_np, rounder, to_compute_form
from megaloop.frontend.tensor import Tensor
from megaloop.frontend.values import coerce
from megaloop.parallel.ranks import match_ranks
from megaloop.reference.ahead import Ahead

PRODUCTS = ("numpy", "torch", "auto")
ACTIVATIONS = ("numpy", "torch", "auto")


# glibc's heap grows and trims this much beyond what it needs (M_TOP_PAD, default 128 KiB), and
# arrays under this size come from the heap (M_MMAP_THRESHOLD; setting either fixes both): the arrays
# a run frees between ops are then reused, not handed back to the OS and faulted in again
HEAP_PAD, HEAP_ARRAYS = 64 << 20, 32 << 20
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3
_padded: list[bool] = []


def pad_the_heap() -> bool:
    """Set glibc's M_TOP_PAD to HEAP_PAD and M_MMAP_THRESHOLD to HEAP_ARRAYS once for this process
    (the fast path's arrays of a few MiB each come and go every op); False where there is no glibc.
    The process may hold up to HEAP_PAD more memory than it uses."""
    if not _padded:
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            linux = sys.platform == "linux"
            done = linux and bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_ARRAYS) and libc.mallopt(_M_TOP_PAD, HEAP_PAD))
        except (OSError, AttributeError):  # (a libc without mallopt)
            done = False
        _padded.append(done)
    return _padded[0]


def _import_quietly() -> None:
    try:
        importlib.import_module("torch")
    except Exception:  # (a broken torch: the prefill's own import raises it where it is needed)
        pass


def _bfloat16_bits(stored: Any, found: np.ndarray | None) -> np.ndarray | None:
    """A bfloat16 parameter's bits as int16 for torch: the stored array itself where it is one dense
    bfloat16 array (a checkpoint's: no copy, no conversion), else ``found`` (compute form) rounded
    (None where ``found`` is None)."""
    if isinstance(stored, np.ndarray) and stored.dtype == bfloat16.np and stored.flags.c_contiguous:
        if found is None or stored.shape == found.shape:
            return stored.view(np.int16)
    return None if found is None else found.astype(bfloat16.np).view(np.int16)


def choose_products(products: str) -> str:
    """What ``products`` allows on this machine: "numpy", or "torch" ("auto": where torch is installed
    and the CPU has bfloat16 dot products, AVX512-BF16 or AMX; fixed for a machine)."""
    if products not in PRODUCTS:
        raise EvaluationError(f"products must be one of {PRODUCTS}, got {products!r}")
    if products != "auto":
        return products
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "numpy"
    torch = {"avx512_bf16", "amx_bf16"} & flags and importlib.util.find_spec("torch") is not None
    return "torch" if torch else "numpy"


def choose_activations(activations: str, products: str) -> str:
    """What ``activations`` allows: "numpy", or "torch" ("auto": where torch is installed, unless the
    products are asked to be numpy's, the reference's bits)."""
    if activations not in ACTIVATIONS:
        raise EvaluationError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if activations != "auto":
        return activations
    return "torch" if products != "numpy" and importlib.util.find_spec("torch") is not None else "numpy"


class ComputeWeights(Mapping[str, Any]):
    """Parameters in their compute form, converted on first use and then kept: one copy for every
    graph prepared with this object (a model's prefill and decode graphs share their weights). As a
    mapping it is ``params`` itself (the arrays as given), for the backends that take those.
    ``products``: what the graphs may use (choose_products): "numpy" (numpy's products only: the
    reference's bits), "torch" (a graph prepared with products="torch" also gets each bfloat16 matrix
    as a torch tensor, for its products of many rows: megaloop.frontend.ops._fast.Weight), "auto".
    ``activations``: whether graphs may run in torch form (choose_activations; FastGraph's
    ``activations``), each parameter then also as a torch tensor of its dtype (``torch_form``)."""

    def __init__(self, params: Mapping[str, Any], products: str = "numpy", activations: str = "numpy") -> None:
        self.params = params
        self.requested, self.products = products, choose_products(products)
        self.requested_activations = activations
        self.activations = choose_activations(activations, products)
        if "torch" in (self.products, self.activations) and importlib.util.find_spec("torch") is None:
            raise EvaluationError(
                "products='torch' or activations='torch' need torch (pip install torch); or use 'numpy'"
            )
        self._converted: dict[tuple[str, tuple[int, ...], str], np.ndarray] = {}
        self._twins: dict[tuple[str, tuple[int, ...], str], np.ndarray] = {}
        self._torch_forms: dict[tuple[str, tuple[int, ...], str], Any] = {}
        self._importing: threading.Thread | None = None
        # made ahead (convert_ahead, FastGraph.prepare_ahead): what a prefill will wait for, and at a
        # lower priority, what only the decode reads (idle cores only, while the prefill runs)
        self.ahead, self.later = Ahead("megaloop-weights"), Ahead("megaloop-weights-later", nice=10)
        pad_the_heap()  # (before the weights' float32 copies, which glibc would give fresh mapped pages)

    def import_torch_early(self) -> None:
        """Start importing torch in a thread (where this object's products or activations may be
        torch's), so that a prefill waits for little or none of it; ``torch()`` waits for it."""
        if "torch" in (self.products, self.activations) and self._importing is None:
            self._importing = threading.Thread(target=_import_quietly, name="megaloop-import-torch", daemon=True)
            self._importing.start()

    def torch(self) -> Any:
        if self._importing is not None:
            self._importing.join()
        return importlib.import_module("torch")

    def twinned(self, t: Tensor) -> bool:
        """Whether a graph prepared for torch's products gets ``t``'s parameter as a bfloat16 twin: a
        bfloat16 matrix (with products="auto", one of TORCH_MIN_WEIGHT values or more)."""
        if t.dtype != bfloat16 or t.ndim != 2:
            return False
        return self.requested == "torch" or t.size >= TORCH_MIN_WEIGHT

    def __getitem__(self, name: str) -> Any:
        return self.params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def has(self, name: str, t: Tensor, torch: bool = False) -> bool:
        """Whether ``name`` is converted for tensor ``t`` already (``torch``: with its torch twin, where
        it gets one)."""
        key = (name, t.shape, t.dtype.name)
        return key in self._converted and (not (torch and self.twinned(t)) or key in self._twins)

    def get(self, name: str, t: Tensor, torch: bool = False) -> np.ndarray:
        """Parameter ``name`` for tensor ``t`` (its shape and dtype checked as ml.evaluate checks them);
        ``torch``: a bfloat16 matrix (``twinned``) as a Weight with its torch twin (the same float32 memory).
        Where ``convert_ahead`` queued it, this waits for it (or converts it, where not started yet)."""
        key = (name, t.shape, t.dtype.name)
        found = self._converted.get(key)
        if found is None:
            self.ahead.wait(key)
            self.later.wait(key)
            found = self._converted.get(key)
        if found is None:
            found = self._convert(name, t)
        if not torch or not self.twinned(t):
            return found
        if self.products != "torch":
            raise EvaluationError(f"parameter {name!r}: torch products need ComputeWeights(products='torch' or 'auto')")
        if key not in self._twins:
            _torch = self.torch()
            twin = Weight(found.shape, np.float32, found)  # (numpy makes a view of this a view of it)
            with warnings.catch_warnings():  # (a read-only checkpoint's memory: nothing writes a twin)
                warnings.simplefilter("ignore", UserWarning)
                bits = _torch.from_numpy(_bfloat16_bits(self.params[name], found))
            twin.bf16 = bits.view(_torch.bfloat16)
            twin.setflags(write=False)
            self._twins[key] = twin
        return self._twins[key]

    def _convert(self, name: str, t: Tensor) -> np.ndarray:
        key, stored = (name, t.shape, t.dtype.name), self.params[name]
        # no copy of a 16-bit weight before its float32 one (a checkpoint's bytes read once), nor of a
        # read-only array (a memory-mapped checkpoint's) that is its compute form already
        converts = t.dtype.is_float and t.dtype.np != np.float32
        kept = isinstance(stored, np.ndarray) and not stored.flags.writeable
        found = to_compute_form(coerce(stored, t, f"parameter {name!r}", copy=not (converts or kept)), t.dtype)
        found.setflags(write=False)  # shared by graphs and steps: nobody writes into a weight
        self._converted[key] = found
        return found

    def convert_ahead(self, parameters: Iterable[tuple[str, Tensor]], later: bool = False) -> int:
        """Queue the conversion of each (name, tensor) not converted nor queued yet on ``ahead``'s
        thread (``later``: ``later``'s, at a lower priority), in the order given (``get`` waits for one,
        or converts it where not started); how many were queued."""
        queued = 0
        for name, t in parameters:
            key = (name, t.shape, t.dtype.name)
            if key not in self._converted and not self.ahead.has(key) and not self.later.has(key):
                what = f"parameter {name!r} (its float32 copy)"
                (self.later if later else self.ahead).submit(key, what, lambda n=name, x=t: self._convert(n, x))
                queued += 1
        return queued

    def pending(self) -> int:
        """Conversions and packings queued or under way on the threads."""
        return self.ahead.pending() + self.later.pending()

    def ready(self, name: str, t: Tensor, torch_form: bool = False) -> bool:
        """Whether ``get`` (``torch_form``: ``torch_form``) has ``name`` for ``t`` without waiting for
        ``ahead``'s thread (a bfloat16 checkpoint's torch form needs no float32 copy)."""
        key = (name, t.shape, t.dtype.name)
        return (torch_form and not self.copied_for_torch(name, t)) or not (self.ahead.has(key) or self.later.has(key))

    def copied_for_torch(self, name: str, t: Tensor) -> bool:
        """Whether ``torch_form`` makes ``name``'s compute form (float32 copy) first: all but a bfloat16
        tensor whose stored array is its dense bfloat16 bits (a checkpoint's)."""
        return t.dtype != bfloat16 or self._own_bits(name, t) is None

    def _own_bits(self, name: str, t: Tensor) -> np.ndarray | None:
        stored = self.params[name]
        return _bfloat16_bits(stored, None) if np.shape(stored) == t.shape else None

    def torch_form(self, name: str, t: Tensor) -> Any:
        """Parameter ``name`` for tensor ``t`` as a torch tensor of its dtype, made once: a bfloat16
        checkpoint's own memory where it can be (no copy, no float32 copy first), a float32 one over
        its compute form."""
        key = (name, t.shape, t.dtype.name)
        if key not in self._torch_forms:
            self.torch()
            if t.dtype == bfloat16:  # (a checkpoint's own bits where they are t's: no float32 copy first)
                bits = self._own_bits(name, t)
                bits = bits if bits is not None else _bfloat16_bits(self.params[name], self.get(name, t))
                made = _torch.from_numpy(bits.view(bfloat16.np))
            else:
                made = _torch.to_torch(self.get(name, t), t.dtype)
            return self._torch_forms.setdefault(key, made)  # (one object for all: a packing keys on it)
        return self._torch_forms[key]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in list(self._converted.values()))  # (ahead's thread may add some)


class FastGraph:
    """``graph`` prepared for repeated runs (module docstring): its states live here between runs,
    as a loop kernel's do. ``params``: a mapping of the graph's parameters or a ``ComputeWeights``.
    ``products``: "numpy", or "torch" (the products of many rows with a bfloat16 weight by torch's
    bfloat16 kernels: within matmul's contract, not the reference's bits). ``activations``: "numpy"
    (values in compute form), or "torch" (values in torch form between ops, megaloop.frontend.ops._torch:
    bfloat16 activations, every op with a torch kernel running it, the products and attention torch's;
    each op within its accuracy contract). ``verify``: check every op's output shape and dtype as it
    runs (tests)."""

    def __init__(
        self,
        graph: Graph,
        params: Mapping[str, Any] | ComputeWeights,
        *,
        products: str = "numpy",
        activations: str = "numpy",
        verify: bool = False,
    ) -> None:
        if not isinstance(graph, Graph):
            raise EvaluationError(f"FastGraph: expected a Graph, got {type(graph).__name__}")
        if graph.world_size != 1:
            raise EvaluationError(
                f"FastGraph: graph {graph.name!r} is rank {graph.rank} of {graph.world_size}; the fast CPU path runs "
                "one rank's graph: evaluate several ranks with ml.evaluate"
            )
        require_results([graph], "FastGraph")
        self.graph = graph
        self.weights = params if isinstance(params, ComputeWeights) else ComputeWeights(params, products)
        if products not in ("numpy", "torch"):
            raise EvaluationError(f"FastGraph: products must be 'numpy' or 'torch', got {products!r}")
        self.torch = products == "torch"
        if activations not in ("numpy", "torch"):
            raise EvaluationError(f"FastGraph: activations must be 'numpy' or 'torch', got {activations!r}")
        self.in_torch = activations == "torch"
        if self.in_torch:
            self.weights.torch()  # (an error here, not in an op, where torch is missing)
        missing = [n for n in graph.parameters if n not in self.weights]
        if missing:
            raise EvaluationError(
                f"graph {graph.name!r}: missing parameters {missing[:8]}; expected {list(graph.parameters)[:8]}..."
            )
        order = [node for _, node in match_ranks([graph]).order]  # an op's in-place write after its readers
        self._slot: dict[Tensor, int] = {}
        self._size = 0  # slots of values in a run
        self._fixed: dict[int, np.ndarray] = {}  # parameters and constants
        self._inputs: dict[str, int] = {}
        self._states: dict[str, int] = {}
        self.nodes: list[Node] = []  # the nodes that run, in order (a step each)
        self._steps: list[tuple[Kernel, list[int], list[int]]] = []
        self._prepares: list[tuple[Callable[[list[Any]], None], list[int], Kernel]] = []
        self._later: dict[int, Callable[[], Any]] = {}  # parameters fetched where first read (ahead's)
        self._before: dict[int, list[Callable[[list[Any]], None]]] = {}  # a step's first run waits for
        self.key = object()  # (its jobs' keys: unlike an id, never another graph's once this one is gone)
        snapshots = _read_after_overwrite(graph, order)
        for node in order:
            self._prepare(node, verify)
        for t in snapshots:  # (a state read at the end but overwritten in place: its value kept first)
            self._snapshot(t)
        self._outputs = {name: (self._slot[t], t) for name, t in graph.outputs.items()}
        self._updates = {name: self._slot[t] for name, t in graph.state_updates.items()}
        self._dead = self._last_uses()
        for slot in self._later:  # (a parameter queued on weights.ahead: fetched by its first reader)
            first = next(i for i, (_, ins, _) in enumerate(self._steps) if slot in ins)
            self._before.setdefault(first, []).append(lambda values, j=slot: values.__setitem__(j, self._value(j)))
        self.state: dict[str, np.ndarray] = {}
        self.reset()

    # ---- preparing ----------------------------------------------------------------------------------
    def _new_slot(self, t: Tensor) -> int:
        self._slot[t], self._size = self._size, self._size + 1
        return self._slot[t]

    def _prepare(self, node: Node, verify: bool) -> None:
        op = node.op
        if op.kind == "source":
            slot = self._new_slot(node.outputs[0])
            name, t = node.attrs["name"], node.outputs[0]
            if op.name == "parameter":
                self._fixed[slot] = None
                self._later[slot] = self._fetcher(name, t)
                if self.weights.ready(name, t, self.in_torch):  # (else fetched where first read)
                    self._value(slot)
            elif op.name == "constant":
                value = to_compute_form(np.asarray(node.attrs["value"]), t.dtype)
                self._fixed[slot] = _torch.to_torch(value, t.dtype) if self.in_torch else value
            elif op.name == "input":
                self._inputs[name] = slot
            else:
                self._states[name] = slot
            return
        if op.kind in ("collective", "p2p"):
            raise EvaluationError(
                f"{op.name} {node.name}: graph {self.graph.name!r} exchanges values with other ranks; the fast CPU "
                "path runs one rank: evaluate several ranks with ml.evaluate"
            )
        kernel = op.fast.make(node) if op.fast is not None else _storage_kernel(node)
        checks = op.check_data is not None and (op.fast is None or not op.fast.checks_data)
        if self.in_torch:
            own = op.fast.torch(node) if op.fast is not None and op.fast.torch is not None else None
            kernel = own if own is not None else _torch.in_numpy(node, kernel)
        prepare = getattr(kernel, "prepare", None) if self.in_torch else None  # (kept between runs)
        if checks:
            kernel = _checked(kernel, node, self.in_torch)
        if verify:
            kernel = _verified(kernel, node, self.in_torch)
        ins = [self._slot[t] for t in node.inputs]
        if prepare is not None:
            self._prepares.append((prepare, ins, kernel))
        self.nodes.append(node)
        self._steps.append((kernel, ins, [self._new_slot(t) for t in node.outputs]))

    def prepare(self) -> int:
        """Let the kernels make what they keep between runs from the parameters (torch form: bfloat16
        linear weights packed for oneDNN) now, a setup phase, rather than not at all; how many did."""
        for prepare, ins, _ in self._prepares:
            self._prepare_kernel(prepare, ins)
        return len(self._prepares)

    def _prepare_kernel(self, prepare: Callable[[list[Any]], None], ins: list[int]) -> None:
        with self._torch_mode():  # (thread-local: entered on the thread that packs)
            prepare([self._value(j) if j in self._fixed else None for j in ins])

    def prepare_ahead(self) -> int:
        """``prepare`` each kernel on ``weights.ahead``'s thread instead (urgent jobs: before the weights'
        conversions), each step's first run waiting for its own: the same kernels whatever the timing;
        how many were queued."""
        steps = {id(kernel): i for i, (kernel, _, _) in enumerate(self._steps)}
        for k, (prepare, ins, kernel) in enumerate(self._prepares):
            key, node = (self.key, k), self.nodes[steps[id(kernel)]]
            what = f"{node.op.name} {node.name} (graph {self.graph.name!r}: its packed weight)"
            job = lambda prepare=prepare, ins=ins: self._prepare_kernel(prepare, ins)
            self.weights.ahead.submit(key, what, job, urgent=True)
            wait = self.weights.ahead.wait
            self._before.setdefault(steps[id(kernel)], []).append(lambda values, key=key, wait=wait: wait(key))
        return len(self._prepares)

    def _fetcher(self, name: str, t: Tensor) -> Callable[[], Any]:
        if self.in_torch:
            return lambda: self.weights.torch_form(name, t)
        return lambda: self.weights.get(name, t, self.torch)

    def _value(self, slot: int) -> Any:
        """A parameter's value, fetched from the weights (waiting for ahead's thread) where not yet."""
        fetch = self._later.get(slot)
        if fetch is not None:
            self._fixed[slot] = fetch()  # (the same object from either thread: the weights keep it)
            self._later.pop(slot, None)
        return self._fixed[slot]

    def _last_uses(self) -> list[list[int]]:
        """For each step, the slots no later step reads (nor the end of the run): dropped after it, so
        that their memory is reused by the next ops' results rather than the heap growing (and faulted
        in) through a run. Parameters, constants, inputs and states stay."""
        kept = {*self._fixed, *self._inputs.values(), *self._states.values(), *self._updates.values()}
        kept.update(slot for slot, _ in self._outputs.values())
        last: dict[int, int] = {}
        for i, (_, ins, outs) in enumerate(self._steps):
            last.update((slot, i) for slot in (*ins, *outs) if slot not in kept)
        dead: list[list[int]] = [[] for _ in self._steps]
        for slot, i in last.items():
            dead[i].append(slot)
        return dead

    def _snapshot(self, t: Tensor) -> None:
        """Copy ``t`` where it is made, before an op overwrites its storage, and read the copy at the end."""
        slot = self._slot[t]
        copy = self._new_slot(t)
        made_by = next((i for i, n in enumerate(self.nodes) if t in n.outputs), -1)
        self._steps.insert(made_by + 1, (lambda arrays: [arrays[0].clone() if self.in_torch else arrays[0].copy()],
                                         [slot], [copy]))  # fmt: skip
        self.nodes.insert(made_by + 1, t.node)

    # ---- states -------------------------------------------------------------------------------------
    def reset(self, state: Mapping[str, Any] | None = None) -> None:
        """Every state to its first value (its init, else zeros), then those of ``state`` given."""
        fresh = {}
        for name, t in self.graph.states.items():
            init = t.node.attrs.get("init")
            value = np.array(init, copy=True) if init is not None else np.zeros(t.shape, t.dtype.np)
            fresh[name] = to_compute_form(value, t.dtype)
        self.state = fresh
        if state:
            self.set_state(state)

    def set_state(self, state: Mapping[str, Any], *, adopt: bool = False) -> None:
        """Replace the states named in ``state`` (arrays of any dtype, checked as ml.evaluate checks them).
        ``adopt``: the arrays are already in compute form (another FastGraph's ``state``) and are taken
        as they are, no copy: that graph must not run on them again (``reset`` it first)."""
        unknown = [n for n in state if n not in self.graph.states]
        if unknown:
            raise EvaluationError(
                f"graph {self.graph.name!r}: unknown state {unknown}; the graph's states are {list(self.graph.states)}"
            )
        for name, value in state.items():
            t = self.graph.states[name]
            as_is = isinstance(value, np.ndarray) and value.shape == t.shape and value.dtype == compute_np(t.dtype)
            if adopt and as_is:
                self.state[name] = value
            else:
                self.state[name] = to_compute_form(coerce(value, t, f"state {name!r}"), t.dtype)

    def read_state(self, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the states (all, or ``names``) in their dtypes, as ml.evaluate returns them."""
        names = list(self.graph.states) if names is None else names
        return {n: _stored(self.state[n], self.graph.states[n]) for n in names}

    # ---- running ------------------------------------------------------------------------------------
    def run(
        self,
        inputs: Mapping[str, Any] | None = None,
        iterations: int = 1,
        on_node: Callable[[int], None] | None = None,
    ) -> dict[str, np.ndarray]:
        """Run the graph ``iterations`` times on ``inputs`` (the same each time), from the states kept
        here; return the last iteration's outputs (copies, in their dtypes). ``on_node(i)`` is called
        after ``self.nodes[i]`` ran (a progress bar)."""
        if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
            raise EvaluationError(f"iterations must be an int >= 1, got {iterations!r}")
        given = dict(inputs or {})
        missing = [n for n in self._inputs if n not in given]
        extra = [n for n in given if n not in self._inputs]
        if missing or extra:
            raise EvaluationError(
                f"graph {self.graph.name!r}: missing inputs {missing}, unknown inputs {extra}; expected "
                f"{list(self._inputs)}"
            )
        values: list[Any] = [None] * self._size
        for slot, value in self._fixed.items():
            values[slot] = value
        for name, slot in self._inputs.items():
            t = self.graph.inputs[name]
            values[slot] = to_compute_form(coerce(given[name], t, f"input {name!r}"), t.dtype)
            if self.in_torch:
                values[slot] = _torch.to_torch(values[slot], t.dtype)
        with np.errstate(all="ignore"), self._torch_mode():  # NaN/inf follow IEEE rules, as on the GPU
            for _ in range(iterations):
                self._iterate(values, on_node)
        return {name: _stored(self._numpy(values[slot], t), t) for name, (slot, t) in self._outputs.items()}

    def _torch_mode(self) -> Any:
        """torch's inference mode where the graph runs in torch form (no autograd records)."""
        return self.weights.torch().inference_mode() if self.in_torch else contextlib.nullcontext()

    def _numpy(self, value: Any, t: Tensor) -> np.ndarray:
        return _torch.to_numpy(value, t.dtype) if self.in_torch else value

    def _iterate(self, values: list[Any], on_node: Callable[[int], None] | None) -> None:
        for name, slot in self._states.items():
            state, t = self.state[name], self.graph.states[name]
            values[slot] = _torch.to_torch(state, t.dtype, keep_float32=True) if self.in_torch else state
        i, before = 0, self._before
        try:
            for i, (kernel, ins, outs) in enumerate(self._steps):
                if before and i in before:  # (a first run: a parameter or a packing made ahead)
                    for first in before[i]:
                        first(values)
                    del before[i]
                for o, r in zip(outs, kernel([values[j] for j in ins])):
                    values[o] = r
                for j in self._dead[i]:
                    values[j] = None
                if on_node is not None:
                    on_node(i)
        except DataError as e:
            node = self.nodes[i]
            raise DataError(f"{node.op.name} {node.name} (graph {self.graph.name!r}): {e}") from None
        for name, slot in self._updates.items():
            new, old = self._numpy(values[slot], self.graph.states[name]), self.state[name]
            if new is old or (self.in_torch and new.shape == old.shape and new.ctypes.data == old.ctypes.data):
                continue  # an op that wrote the state in place returned its buffer: kept, not copied
            self.state[name] = np.array(new, copy=True)


def evaluate_fast(
    graph: Graph,
    inputs: Mapping[str, Any] | None = None,
    params: Mapping[str, Any] | ComputeWeights | None = None,
    state: Mapping[str, Any] | None = None,
    *,
    iterations: int = 1,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``ml.evaluate`` of one graph on the fast path: (outputs, states after the last iteration)."""
    run = FastGraph(graph, params or {})
    run.reset(state)
    outputs = run.run(inputs, iterations)
    return outputs, run.read_state()


# ---- kernels the executor wraps around an op's ------------------------------------------------------


def _stored(value: np.ndarray, t: Tensor) -> np.ndarray:
    """A compute-form value as a new array of ``t``'s dtype."""
    return np.array(value, dtype=t.dtype.np, copy=True)


def _storage_kernel(node: Node) -> Kernel:
    """An op without a fast implementation: its reference on the operands in their storage dtypes,
    its outputs rounded (as ml.evaluate stores them) and back in compute form."""
    reference, attrs = node.op.reference, node.attrs
    if reference is None:
        raise EvaluationError(f"{node.op.name} {node.name}: the op has no reference to run on the CPU")
    storage = [t.dtype.np for t in node.inputs]
    finish = [rounder(t.dtype) for t in node.outputs]

    def run(arrays: list[np.ndarray]) -> list[np.ndarray]:
        result = reference([a.astype(d, copy=False) for a, d in zip(arrays, storage)], attrs)
        results = result if isinstance(result, list) else [result]
        return [f(r) for f, r in zip(finish, results)]

    return run


def _checked(kernel: Kernel, node: Node, in_torch: bool = False) -> Kernel:
    check, attrs, unknown = node.op.check_data, node.attrs, [None] * len(node.inputs)

    def run(arrays: list[Any]) -> list[Any]:
        check([_torch.viewed(a) for a in arrays] if in_torch else arrays, attrs, unknown)  # type: ignore[misc]
        return kernel(arrays)

    return run


def _verified(kernel: Kernel, node: Node, in_torch: bool = False) -> Kernel:
    """Each output's shape and dtype as the shape rule says: compute form, or torch form (a float of
    its dtype, or float32 where it is a state's buffer)."""
    want = [(t.shape, compute_np(t.dtype)) for t in node.outputs]
    if in_torch:
        kinds = [{_torch.torch_dtype(t.dtype), *([_torch.torch().float32] if t.dtype.is_float else [])}
                 for t in node.outputs]  # fmt: skip

    def run(arrays: list[Any]) -> list[Any]:
        out = kernel(arrays)
        if in_torch:
            bad = [(tuple(a.shape), a.dtype) for a, k in zip(out, kinds) if a.dtype not in k]
            got = [(tuple(a.shape), compute_np(t.dtype)) for a, t in zip(out, node.outputs)]
            if bad:
                raise InternalError(f"{node!r}: its torch kernel gave {bad}, the shape rule says {want}")
        else:
            got = [(np.shape(a), np.asarray(a).dtype) for a in out]
        if got != want:
            raise InternalError(f"{node!r}: its fast kernel gave {got}, the shape rule says {want}")
        return out

    return run


def _read_after_overwrite(graph: Graph, order: list[Node]) -> list[Tensor]:
    """Outputs and state updates that read a storage an op overwrites in place (other than that op's
    own result): ml.evaluate gives them the value before the write, so the fast path copies them."""
    overwritten = {n.inputs[n.op.inplace_operand].base: n for n in order if n.op.inplace_operand is not None}
    read = list(graph.outputs.values()) + list(graph.state_updates.values())
    return list(dict.fromkeys(t for t in read if t.base in overwritten and t not in overwritten[t.base].outputs))
