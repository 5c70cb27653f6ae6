"""``Trainer``: fine-tune a Llama-family checkpoint (a Hugging Face folder, or a config and weights
built in Python) on token data, the whole run as loop iterations: each iteration is one micro-batch
of the training graph (megaloop/training/graph.py; split over ``devices`` ranks by
megaloop/training/split.py), many of them run at once with no host work between them; the host only
reads the histories (loss, lr, gradient norm) to report progress, and the weights to write a
checkpoint every ``save_every`` steps and at the end.

    trainer = ml.Trainer("tiny-llama", ml.TrainSettings(steps=100, batch=8, seq=256, backend="gpu"),
                         output="tiny-tuned")
    result = trainer.train(["notes.txt", "more.txt"])     # or token ids, or packed windows
    result.losses                                          # each optimizer step's mean loss
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from megaloop.dtypes import as_dtype
from megaloop.errors import UsageError
from megaloop.models.checkpoint import load_llama
from megaloop.models.hf_config import family_of, rope_interleaved
from megaloop.models.llama import LlamaConfig
from megaloop.models.tokenizer import Tokenizer
from megaloop.training import data as training_data
from megaloop.training.checkpoint import check_output, save_checkpoint
from megaloop.training.flops import model_flops_per_token, peak_flops
from megaloop.training.graph import LOSSES, LRS, NORMS, OptimizerSettings, TrainingGraph, build_training_graph
from megaloop.training.runners import BACKENDS, make_ranks_runner, make_runner
from megaloop.training.split import SplitTraining, build_split_training, check_strategy, rank_histories

TRAIN_DTYPES = ("bfloat16", "float32")
GPU_STEPS_A_RUN = 10  # optimizer steps a loop kernel run takes between progress reads (the default)


@dataclass(frozen=True)
class TrainSettings:
    """A run: ``steps`` optimizer updates of ``batch`` windows of ``seq`` tokens (times the optimizer's
    ``accumulate`` micro-batches); ``dtype`` the compute dtype (None: the checkpoint's; bfloat16 keeps
    float32 master weights and moments); ``backend`` "cpu" (the fast CPU path, slow), "reference"
    (the numpy definition, slower) or "gpu"; ``devices`` and ``strategy`` how the step is split
    (``ml.parallelize_training``'s names: "auto" the cost model's choice, "dp", "zero1", "zero2",
    "tp", "pp", or axes with sizes such as "pp2xtp2"), ``micro_batches`` a pipeline's chains,
    ``recompute`` each layer's activations in its backward, ``gpus`` the GPU of each rank (None: rank
    r on GPU r, or round robin when there are fewer: ranks then share a GPU); a checkpoint every
    ``save_every`` steps (None: at the end only); ``seed`` orders the data's windows;
    ``steps_per_run``: steps between progress reads (None: 1 on the CPU, 10 on the GPU)."""

    steps: int
    batch: int = 8
    seq: int = 512
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    dtype: str | None = None
    backend: str = "cpu"
    devices: int = 1
    strategy: str = "auto"
    micro_batches: int | None = None
    recompute: bool = False
    gpus: tuple[int, ...] | None = None
    save_every: int | None = None
    seed: int = 0
    steps_per_run: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq", "devices"):
            _count(name, getattr(self, name))
        for name in ("save_every", "steps_per_run", "micro_batches"):
            if getattr(self, name) is not None:
                _count(name, getattr(self, name))
        if self.backend not in BACKENDS:
            raise UsageError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        check_strategy(self.strategy, self.devices)
        if self.devices == 1 and (self.micro_batches or 1) > 1:
            raise UsageError(
                "micro_batches (--micro-batches) cut a pipeline's batch; give --devices and a 'pp' strategy"
            )
        if self.gpus is not None:
            object.__setattr__(self, "gpus", tuple(self.gpus))
            if len(self.gpus) != self.devices:
                raise UsageError(f"gpus {list(self.gpus)}: give one GPU for each of the {self.devices} devices")
        if self.dtype is not None and self.dtype not in TRAIN_DTYPES:
            why = " (16-bit floats without bfloat16's range need loss scaling, which megaloop does not do)"
            raise UsageError(
                f"dtype must be one of {TRAIN_DTYPES}, got {self.dtype!r}{why if self.dtype == 'float16' else ''}"
            )


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be an int >= 1, got {value!r}")


@dataclass
class TrainResult:
    """``losses``: each optimizer step's mean loss (over its micro-batches); ``micro_losses``: every
    iteration's; ``tokens_per_second`` over the runs of the loop (setup not counted); ``mfu``: model
    FLOP utilisation (None where the device's peak is unknown: the CPU); ``output``: the last
    checkpoint written; ``split``: how the step was split over ranks ("dp2", "pp2xtp2", "1 device")."""

    losses: list[float]
    micro_losses: list[float]
    seconds: float
    tokens_per_second: float
    mfu: float | None
    output: Path | None
    split: str = "1 device"  # the strategy the step ran as (parallelize_training's label)


class Trainer:
    """See the module docstring. ``model``: a checkpoint folder (Llama, Mistral, Qwen2/3 and the other
    families ``megaloop generate`` loads, except fused or interleaved ones) or a LlamaConfig with
    ``params``; ``output``: where checkpoints go (checked now: a missing or empty folder, or
    ``overwrite``); ``progress``: a tqdm bar on stderr (None: when stderr is a terminal)."""

    def __init__(
        self,
        model: str | Path | LlamaConfig,
        settings: TrainSettings,
        *,
        params: Mapping[str, Any] | None = None,
        output: str | Path | None = None,
        overwrite: bool = False,
        progress: bool | None = None,
    ) -> None:
        if not isinstance(settings, TrainSettings):
            raise UsageError(f"Trainer: settings must be a TrainSettings, got {type(settings).__name__}")
        self.settings = settings
        self.folder = None if isinstance(model, LlamaConfig) else Path(model)
        self.output = check_output(output, self.folder, overwrite) if output is not None else None
        self.progress = sys.stderr.isatty() if progress is None else progress
        if self.folder is None:
            if params is None:
                raise UsageError("Trainer: a LlamaConfig model needs its weights (params=)")
            cfg = model if settings.dtype is None else dataclasses.replace(model, dtype=settings.dtype)
            self.cfg, self.params = cfg, dict(params)
        else:
            self.cfg, self.params = _load(self.folder, settings.dtype)
        if self.cfg.dtype.name not in TRAIN_DTYPES:
            raise UsageError(
                f"the model computes in {self.cfg.dtype.name}; train in bfloat16 or float32 (--dtype / dtype=)"
            )
        if settings.seq > self.cfg.max_seq:
            raise UsageError(
                f"seq {settings.seq} is beyond the model's {self.cfg.max_seq} positions (max_position_embeddings)"
            )
        self.stored = {n: np.asarray(v).dtype for n, v in self.params.items()}
        self.training: TrainingGraph | SplitTraining | None = None
        self.runner: Any = None
        self._history: list[dict[str, list[float]]] = []
        self.steps_done = 0

    # ---- data ---------------------------------------------------------------------------------------
    def tokenizer(self) -> Tokenizer:
        if self.folder is None:
            raise UsageError(
                "Trainer: text needs the checkpoint's tokenizer; give token ids for a model built in Python"
            )
        return Tokenizer.from_folder(self.folder)

    def windows(self, data: Any) -> np.ndarray:
        """``data`` (text files, a 1-D stream of token ids, or windows [n, batch, seq + 1]) as the
        windows a run reads: int64 [batches, batch, seq + 1], at most one batch a micro-batch."""
        s = self.settings
        limit = s.steps * s.optimizer.accumulate
        if isinstance(data, (str, Path)) or (isinstance(data, Sequence) and data and isinstance(data[0], (str, Path))):
            tokens = training_data.tokenize(self.tokenizer(), [data] if isinstance(data, (str, Path)) else data)
        else:
            tokens = np.asarray(data)
            if tokens.ndim == 3:
                if tokens.shape[1:] != (s.batch, s.seq + 1):
                    raise UsageError(f"training windows must be [n, {s.batch}, {s.seq + 1}], got {list(tokens.shape)}")
                return self._checked_ids(tokens[:limit].astype(np.int64))
        return self._checked_ids(training_data.pack(tokens, batch=s.batch, seq=s.seq, seed=s.seed, limit=limit))

    def _checked_ids(self, windows: np.ndarray) -> np.ndarray:
        bad = (windows < 0) | (windows >= self.cfg.vocab)
        if bad.any():
            raise UsageError(
                f"training data: token id {int(windows[bad][0])} is outside the model's vocabulary of {self.cfg.vocab}"
            )
        return windows

    # ---- running ------------------------------------------------------------------------------------
    def train(self, data: Any) -> TrainResult:
        """Run ``settings.steps`` optimizer steps on ``data`` (see ``windows``); checkpoints into
        ``output`` (every save_every steps into output/checkpoint-<step>, and at the end)."""
        s = self.settings
        states = self.build(data)
        if s.devices == 1:
            if s.backend != "gpu":
                self._say(
                    f"training on the CPU ({s.backend} backend): correct but slow; --backend gpu uses the loop kernel"
                )
            self.runner = make_runner(s.backend, self.training.graph, states[0], self.progress)
        else:
            self._say(f"the step split over {s.devices} ranks: {self.training.split.summary()}")
            if s.backend != "gpu":
                self._say(
                    f"training {s.devices} ranks on the CPU: every rank on the numpy reference (the fast CPU path runs "
                    "one device only): correct but very slow; --backend gpu uses the loop kernels"
                )
            self.runner = make_ranks_runner(s.backend, self.training.graphs, states, s.gpus, self.progress)
        try:
            result = self._loop()
            # a closed runner's memory is gone (a GPU's arena freed): keep what the caller may still ask for
            self.params, self._history = self.weights(), self.histories()
            return result
        finally:
            self.runner.close()
            self.runner = None

    def build(self, data: Any) -> list[dict[str, Any]]:
        """The training step's graph(s) for ``data`` (``self.training``) and each rank's initial state;
        what ``train`` runs (scripts/precompile.py plans and compiles it without a GPU)."""
        s = self.settings
        windows = self.windows(data)
        accumulate = s.optimizer.accumulate
        if windows.shape[0] < s.steps * accumulate:
            self._say(
                f"the data holds {windows.shape[0]} batches of {s.batch} x {s.seq + 1} tokens for "
                f"{s.steps * accumulate} micro-batches: later steps read it again from the start"
            )
        sizes = {"batch": s.batch, "seq": s.seq, "batches": windows.shape[0], "iterations": s.steps * accumulate}
        if s.devices == 1:
            self.training = build_training_graph(self.cfg, optimizer=s.optimizer, **sizes)
            return [self.training.initial_state(self.params, windows)]
        self.training = build_split_training(
            self.cfg, optimizer=s.optimizer, devices=s.devices, strategy=s.strategy,
            micro_batches=s.micro_batches, recompute=s.recompute, **sizes,
        )  # fmt: skip
        return list(self.training.initial_state(self.params, windows))

    def _loop(self) -> TrainResult:
        from tqdm import tqdm

        s, k = self.settings, self.settings.optimizer.accumulate
        per_run = s.steps_per_run or (GPU_STEPS_A_RUN if s.backend == "gpu" else 1)
        tokens_a_step = s.batch * s.seq * k
        flops = model_flops_per_token(self.cfg, s.seq) * tokens_a_step
        peak = peak_flops(getattr(getattr(self.runner, "gpu", None), "name", ""), self.cfg.dtype.name)
        if peak is not None:  # (ranks sharing a GPU share its peak)
            peak *= len(set(getattr(self.runner, "devices", [0])))
        micro: list[float] = []
        seconds, last = 0.0, None
        bar = tqdm(total=s.steps, desc="train", unit="step", file=sys.stderr, disable=not self.progress)
        with bar:
            while self.steps_done < s.steps:
                n = min(per_run, s.steps - self.steps_done)
                if s.save_every:
                    n = min(n, s.save_every - self.steps_done % s.save_every)
                t0 = time.perf_counter()
                self.runner.run(n * k)
                history = self.runner.read([n for n in (LOSSES, LRS, NORMS) if self._holds(n)])
                seconds += time.perf_counter() - t0
                micro += [float(x) for x in history[LOSSES].reshape(-1)[len(micro) : len(micro) + n * k]]
                self.steps_done += n
                rate = tokens_a_step * self.steps_done / seconds
                mfu = flops * self.steps_done / seconds / peak if peak else None
                last_of = {h: float(v.reshape(-1)[len(micro) - 1]) for h, v in history.items()}
                bar.set_postfix_str(
                    _postfix(float(np.mean(micro[-k:])), last_of.get(LRS), last_of.get(NORMS), rate, mfu), refresh=False
                )
                bar.update(n)
                if s.save_every and self.steps_done % s.save_every == 0 and self.steps_done < s.steps and self.output:
                    last = self.save(self.output / f"checkpoint-{self.steps_done}", micro)
        if self.output is not None:
            last = self.save(self.output, micro)
        losses = [float(np.mean(micro[i * k : (i + 1) * k])) for i in range(len(micro) // k)]
        rate = tokens_a_step * s.steps / seconds if seconds else 0.0
        mfu = flops * s.steps / seconds / peak if peak and seconds else None
        split = self.training.split.options.strategy if isinstance(self.training, SplitTraining) else "1 device"
        return TrainResult(losses, micro, seconds, rate, mfu, last, split)

    def _holds(self, name: str) -> bool:
        graphs = self.training.graphs if isinstance(self.training, SplitTraining) else [self.training.graph]
        return any(name in g.states for g in graphs)

    def histories(self) -> list[dict[str, list[float]]]:
        """Each rank's loss (the ranks that hold it), learning rate and gradient norm (with clipping)
        for every micro-batch run so far: a split's ranks hold one device's values."""
        if self.training is None or self.runner is None:
            return self._history
        graphs = self.training.graphs if isinstance(self.training, SplitTraining) else [self.training.graph]
        return rank_histories(graphs, self.runner.read_ranks, self.steps_done * self.settings.optimizer.accumulate)

    def _say(self, text: str) -> None:
        print(f"megaloop train: {text}", file=sys.stderr)

    # ---- weights and checkpoints ---------------------------------------------------------------------
    def weights(self) -> dict[str, np.ndarray]:
        """The current weights under their checkpoint names, each in the dtype the checkpoint stored it
        in (a 16-bit weight from its float32 master, rounded once)."""
        if self.training is None or self.runner is None:
            return {n: np.asarray(v) for n, v in self.params.items()}
        if isinstance(self.training, SplitTraining):
            values = self.training.masters(self.runner.read_ranks)
            return {n: _stored_as(v, self.stored[n]) for n, v in values.items()}
        masters = self.training.optimizer.masters
        values = self.runner.read([masters.get(n, n) for n in self.training.weights])
        return {n: _stored_as(values[masters.get(n, n)], self.stored[n]) for n in self.training.weights}

    def save(self, folder: str | Path, micro_losses: Sequence[float] = ()) -> Path:
        """A checkpoint of the current weights in ``folder`` (megaloop/training/checkpoint.py)."""
        if self.folder is None:
            raise UsageError(
                "Trainer.save: a checkpoint copies the source folder's config and tokenizer; this model has none"
            )
        k = self.settings.optimizer.accumulate
        record = {
            "source": str(self.folder),
            "steps": self.steps_done,
            "settings": json.loads(json.dumps(dataclasses.asdict(self.settings), default=str)),
            "losses": [float(np.mean(micro_losses[i * k : (i + 1) * k])) for i in range(len(micro_losses) // k)],
        }
        return save_checkpoint(folder, self.weights(), self.folder, record)


def _load(folder: Path, dtype: str | None) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = None  # (load_llama says what is wrong)
    if isinstance(config, dict) and "model_type" in config:
        if family_of(config).fused or rope_interleaved(config):
            raise UsageError(
                f"{folder}: training a checkpoint with fused projections or interleaved rope is not supported yet "
                "(its checkpoint would have to be written back in that layout)"
            )
    return load_llama(folder, dtype=as_dtype(dtype) if dtype else None)


def _stored_as(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.dtype(ml_dtypes.bfloat16) or dtype.itemsize == 2:
        return np.asarray(value, np.float32).astype(dtype)
    return np.asarray(value).astype(dtype)


def _postfix(loss: float, lr: float | None, norm: float | None, rate: float, mfu: float | None) -> str:
    lr_text = f", lr {lr:.2e}" if lr is not None else ""
    norm_text = f", grad norm {norm:.3g}" if norm is not None else ""
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    return f"loss {loss:.4f}{lr_text}{norm_text}, {rate:,.0f} tok/s, MFU {mfu_text}"
