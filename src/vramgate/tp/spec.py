"""What a tensor-parallel run is and what it gives back: the MLP shape, :class:`TPSpec`, each rank's
:class:`RankResult`, and the pure figures drawn from them (overlap fraction, peak change).

The launcher (:mod:`vramgate.tp.launch`) writes a spec for its ranks; each rank
(:mod:`vramgate.tp.worker`) reads it and writes its result. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vramgate.core.records import record_fields

#: The MLP variants a worker runs (see :mod:`vramgate.tp.worker`); ``fused`` needs CUDA symmetric memory.
VARIANTS = ("sync", "overlap", "fused")
DEVICES = ("cpu", "cuda")
BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPES = tuple(DTYPE_BYTES)


class TPSpecError(ValueError):
    """A tensor-parallel spec that cannot run; names the field and the accepted values."""


class TPError(RuntimeError):
    """A tensor-parallel run that failed: a rank died, exited non-zero, or the run timed out.

    ``rank`` is the rank blamed (None when the whole run timed out), ``log_tail``
    its output's last lines, ``run_dir`` the run's folder.
    """

    def __init__(self, message: str, *, rank: int | None = None, log_tail: str = "",
                 run_dir: Path | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.log_tail = log_tail
        self.run_dir = run_dir


@dataclass(frozen=True)
class MLPShape:
    """A gated MLP block (gate/up projection, SiLU-and-multiply, down projection) over ``tokens`` tokens.

    ``intermediate`` is the whole block's intermediate size; each of the
    ``world_size`` ranks holds ``intermediate / world_size`` of it.
    """

    tokens: int
    hidden: int
    intermediate: int

    def check(self, world_size: int, chunks: int, where: str = "shape") -> None:
        """Raise :class:`TPSpecError` when the shape cannot be split over *world_size* ranks and *chunks*."""
        for name in ("tokens", "hidden", "intermediate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need a positive integer")
        if self.tokens % (world_size * chunks):
            raise TPSpecError(
                f"{where} field 'tokens' = {self.tokens}: must be a multiple of world_size x chunks = "
                f"{world_size} x {chunks} = {world_size * chunks} (each rank's sequence shard is split in chunks)")
        if self.intermediate % world_size:
            raise TPSpecError(f"{where} field 'intermediate' = {self.intermediate}: must be a multiple of "
                              f"world_size {world_size} (column/row-parallel split)")

    def weight_bytes_per_rank(self, world_size: int, dtype_bytes: int) -> int:
        """Bytes of one rank's weight shards: gate/up ``hidden x 2I/w`` and down ``I/w x hidden``."""
        return 3 * self.hidden * (self.intermediate // world_size) * dtype_bytes

    def tensor_bytes(self, world_size: int, dtype_bytes: int) -> dict[str, int]:
        """Bytes of the tensors one rank's step creates, and the most of them alive at once (``step_peak``).

        ``gathered`` (tokens x hidden), ``gate_up`` (tokens x 2I/w), ``act``
        (tokens x I/w), ``down`` (tokens x hidden, the partial sums) and
        ``out`` (tokens/w x hidden). A step frees each after its consumer:
        gathered + gate_up, then gate_up + act, act + down, down + out.
        """
        i_loc = self.intermediate // world_size
        t = {
            "gathered": self.tokens * self.hidden * dtype_bytes,
            "gate_up": self.tokens * 2 * i_loc * dtype_bytes,
            "act": self.tokens * i_loc * dtype_bytes,
            "down": self.tokens * self.hidden * dtype_bytes,
            "out": self.tokens // world_size * self.hidden * dtype_bytes,
        }
        t["step_peak"] = max(t["gathered"] + t["gate_up"], t["gate_up"] + t["act"], t["act"] + t["down"],
                             t["down"] + t["out"])
        return t


@dataclass(frozen=True)
class TPSpec:
    """One tensor-parallel measurement run: what every rank executes."""

    world_size: int
    device: str
    shape: MLPShape
    variants: tuple[str, ...] = ("sync", "overlap")
    dtype: str = "float32"
    chunks: int = 4
    """Pieces each rank's sequence shard is split into for the overlapped variant's pipeline."""
    samples: int = 12
    """Measured rounds; each round times every variant, communication alone and compute alone once."""
    warmup: int = 2
    seed: int = 0
    timeout_s: float = 120.0
    """Deadline for the whole run, from the start of the first rank."""
    collective_timeout_s: float = 60.0
    """``torch.distributed`` timeout of each collective."""
    hold_rank: int | None = None
    """A rank that waits ``hold_s`` seconds after its warm-up (``rank<R>.holding`` marks it), to test failures."""
    hold_s: float = 0.0

    @property
    def backend(self) -> str:
        """The ``torch.distributed`` backend of the spec's device: ``gloo`` on CPU, ``nccl`` on CUDA."""
        return BACKENDS[self.device]

    def validate(self, where: str = "tp spec") -> None:
        """Raise :class:`TPSpecError` naming the first field that cannot run."""

        def positive_int(name: str, value: object, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need an integer >= {minimum}")

        positive_int("world_size", self.world_size)
        if self.device not in DEVICES:
            raise TPSpecError(f"{where} field 'device' = {self.device!r}: accepted: {', '.join(DEVICES)}")
        if not isinstance(self.shape, MLPShape):
            raise TPSpecError(f"{where} field 'shape': need an MLPShape, got {type(self.shape).__name__}")
        positive_int("chunks", self.chunks)
        positive_int("samples", self.samples, 2)
        positive_int("warmup", self.warmup, 0)
        positive_int("seed", self.seed, 0)
        self.shape.check(self.world_size, self.chunks, f"{where} shape")
        if not self.variants:
            raise TPSpecError(f"{where} field 'variants': need at least one of {', '.join(VARIANTS)}")
        for v in self.variants:
            if v not in VARIANTS:
                raise TPSpecError(f"{where} field 'variants': {v!r} is not one of {', '.join(VARIANTS)}")
        if len(set(self.variants)) != len(self.variants):
            raise TPSpecError(f"{where} field 'variants': {list(self.variants)} names a variant twice")
        if "fused" in self.variants and self.device != "cuda":
            raise TPSpecError(f"{where} field 'variants': 'fused' (torch's symmetric-memory fused all-gather "
                              "matmul) runs on device 'cuda' only")
        if self.dtype not in DTYPES:
            raise TPSpecError(f"{where} field 'dtype' = {self.dtype!r}: accepted: {', '.join(DTYPES)}")
        for name in ("timeout_s", "collective_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise TPSpecError(f"{where} field {name!r} = {value!r}: need a positive number of seconds")
        if self.hold_rank is not None and not (
                isinstance(self.hold_rank, int) and 0 <= self.hold_rank < self.world_size):
            raise TPSpecError(f"{where} field 'hold_rank' = {self.hold_rank!r}: need a rank in "
                              f"0..{self.world_size - 1} or None")
        if isinstance(self.hold_s, bool) or not isinstance(self.hold_s, int | float) or self.hold_s < 0:
            raise TPSpecError(f"{where} field 'hold_s' = {self.hold_s!r}: need a number of seconds >= 0")

    def to_json(self) -> dict[str, Any]:
        """The spec as a JSON object (what :meth:`from_json` reads)."""
        data = dataclasses.asdict(self)
        data["variants"] = list(self.variants)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "tp spec") -> TPSpec:
        """Build and validate a spec; errors name *where* and the field."""
        fields = record_fields(cls, data, where, TPSpecError)
        shape = fields["shape"]
        if not isinstance(shape, dict) or set(shape) != {"tokens", "hidden", "intermediate"}:
            raise TPSpecError(f"{where} field 'shape': need an object with tokens, hidden, intermediate; got {shape!r}")
        fields["shape"] = MLPShape(**shape)
        if isinstance(fields.get("variants"), list):
            fields["variants"] = tuple(fields["variants"])
        spec = cls(**fields)
        spec.validate(where)
        return spec


@dataclass
class VariantResult:
    """What one rank measured for one MLP variant."""

    step_s: list[float]
    """Wall time of each measured step (one per round), after a barrier that lines the ranks up."""
    peak_bytes: list[int]
    """Peak memory each measured step added (CPU: peak RSS; CUDA: allocator peak + memory outside the allocator)."""
    max_abs_err: float
    """Largest difference of this rank's output rows from a single-process reference."""
    allocator_peak_bytes: list[int] = field(default_factory=list)
    """CUDA only: the caching allocator's peak above what was allocated at the step's start."""
    comm_s: list[float] = field(default_factory=list)
    """Per round: this variant's collectives alone, without the compute (the ``fused`` variant cannot be split:
    its figure is the plain all-gather and reduce-scatter of the same tensors)."""
    comm_peak_bytes: list[int] = field(default_factory=list)
    """Per round: peak memory the collectives alone added (with the tensors they are handed)."""
    outside_allocator_bytes: int | None = None
    """CUDA only: device memory (NVML) the variant added that the allocator did not reserve (NCCL, symmetric memory)."""


@dataclass
class RankResult:
    """One rank's result file (``rank<R>.json``)."""

    rank: int
    world_size: int
    backend: str
    device: str
    device_name: str
    versions: dict[str, str]
    memory_probe: str
    variants: dict[str, VariantResult]
    compute_s: list[float]
    """Per round: the MLP's compute alone, on an input already gathered."""
    tolerance: float
    """The largest output error accepted against the reference (relative to its largest value)."""
    reference_max_abs: float
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: Any, where: str) -> RankResult:
        """Parse a rank's result; :class:`TPError` naming *where* and the field when it is malformed."""
        fields = record_fields(cls, data, where, TPError, ignore_unknown=True)
        variants = fields["variants"]
        if not isinstance(variants, dict) or not variants:
            raise TPError(f"{where} field 'variants': need an object of variant results, got {variants!r}")
        parsed: dict[str, VariantResult] = {}
        for name, v in variants.items():
            part = f"{where} field 'variants.{name}'"
            if not isinstance(v, dict) or not {"step_s", "peak_bytes", "max_abs_err", "comm_s"} <= set(v):
                raise TPError(f"{part}: need step_s, peak_bytes, comm_s and max_abs_err")
            parsed[name] = VariantResult(**record_fields(VariantResult, v, part, TPError, ignore_unknown=True))
        if not isinstance(fields["compute_s"], list) or len(fields["compute_s"]) < 2:
            raise TPError(f"{where} field 'compute_s': need a list of at least 2 samples")
        rounds = len(fields["compute_s"])
        for name, v in parsed.items():
            if not len(v.step_s) == len(v.peak_bytes) == len(v.comm_s) == len(v.comm_peak_bytes) == rounds:
                raise TPError(f"{where} field 'variants.{name}': {len(v.step_s)} step times, {len(v.peak_bytes)} "
                              f"peaks and {len(v.comm_s)} communication times for {rounds} rounds")
        fields["variants"] = parsed
        return cls(**fields)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON object (what :meth:`from_json` reads)."""
        return dataclasses.asdict(self)

    def overlap(self, variant: str) -> list[float]:
        """Per round, the fraction of the shorter of communication and compute that *variant* hid."""
        v = self.variants[variant]
        return [overlap_fraction(c, k, s) for c, k, s in zip(v.comm_s, self.compute_s, v.step_s, strict=True)]


def overlap_fraction(t_comm: float, t_compute: float, t_step: float) -> float:
    """How much of the shorter of communication and compute a step hid, in [0, 1].

    ``(t_comm + t_compute - t_step) / min(t_comm, t_compute)``, clipped: 0 when
    the step took as long as both run back to back, 1 when it took no longer
    than the longer one alone.
    """
    for name, value in (("t_comm", t_comm), ("t_compute", t_compute), ("t_step", t_step)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"overlap_fraction: {name} must be a positive number of seconds, got {value!r}")
    hidden = (t_comm + t_compute - t_step) / min(t_comm, t_compute)
    return min(1.0, max(0.0, hidden))


def peak_change(baseline: float, candidate: float) -> float:
    """Relative change of *candidate*'s peak against *baseline*'s (-0.19 = 19% lower)."""
    if baseline <= 0:
        raise ValueError(f"peak_change: the baseline peak must be positive, got {baseline!r}")
    return candidate / baseline - 1.0
