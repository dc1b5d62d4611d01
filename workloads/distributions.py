"""Length distributions and arrival processes, each a small validated config that samples.

Every class is both the YAML schema of its section and the sampler it describes: read the
fields to know what to write, call ``sample`` to draw. Draws are vectorised (numpy) and take
an explicit ``numpy.random.Generator``, so a seed fixes everything.
"""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

Z99 = 2.3263478740408408  # standard normal 99th percentile
# The longest length given or drawn (tokens, turns), and the longest context taken: no
# model's comes near (10 M tokens in 2026), and a heavy tail drawn past it is clipped here, so
# that lengths, their sums and their bytes stay within 64-bit integers.
MAX_LENGTH = 1 << 32
# The longest wait a setting may ask for (a think time, a burst, a retry's back-off), and the
# latest a request may arrive: 1e9 s is 31 years, and past about 1e15 s a float clock no
# longer adds a step's milliseconds, so that time would stand still.
MAX_TIME_S = 1e9


class YamlFlag(str):
    """A yes/no flag where a number belongs (YAML reads yes, on and true as true; no, off and
    false as false): its text, which a numeric field refuses, marked so that the refusal
    can say it was a flag."""


class ConfigModel(BaseModel):
    """Base of every scenario section: unknown keys are errors, values are checked (numbers
    finite: an infinite weight or rate would turn the arithmetic into NaN, not an error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_flag_for_a_number(cls, data: Any) -> Any:
        # YAML reads true/false (and yes/no, on/off) as flags, which pydantic would take for
        # 1 and 0: a block size of true is a mistake, not a block of one token. As text, the
        # field refuses it as it refuses any word.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        flags = {key: YamlFlag(str(value).lower()) for key, value in data.items()
                 if isinstance(value, bool) and key in fields
                 and _numbers_only(fields[key].annotation)}
        return {**data, **flags} if flags else data


def _numbers_only(annotation: Any) -> bool:
    """Whether a field of this type holds nothing but numbers (or nothing at all)."""
    members = [m for m in _members(annotation) if m is not type(None)]
    return bool(members) and all(m in (int, float) for m in members)


def _members(annotation: Any) -> list[Any]:
    """The types a field's annotation admits, its unions and annotations unwrapped."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


# ---------------------------------------------------------------------- lengths
class _LengthBase(ConfigModel):
    """Integer lengths, rounded and clipped to ``[min, max]``."""

    min: PositiveInt = Field(default=1, le=MAX_LENGTH)
    max: PositiveInt | None = Field(default=None, le=MAX_LENGTH)

    @model_validator(mode="after")
    def _bounds(self):  # type: ignore[no-untyped-def]
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def raw(self, rng: np.random.Generator, size: int, base_dir: Path) -> np.ndarray:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, size: int, base_dir: Path = Path()) -> np.ndarray:
        with np.errstate(over="ignore"):  # a tail past any float is clipped like the rest
            values = np.rint(self.raw(rng, size, base_dir))
        upper = MAX_LENGTH if self.max is None else self.max
        return np.clip(values, self.min, upper).astype(np.int64)


class ConstantLength(_LengthBase):
    """Every request the same length."""

    dist: Literal["constant"]
    value: PositiveInt = Field(le=MAX_LENGTH)

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return np.full(size, float(self.value))


class UniformLength(_LengthBase):
    """Uniform integers in ``[low, high]``."""

    dist: Literal["uniform"]
    low: PositiveInt = Field(le=MAX_LENGTH)
    high: PositiveInt = Field(le=MAX_LENGTH)

    @model_validator(mode="after")
    def _order(self):  # type: ignore[no-untyped-def]
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return rng.integers(self.low, self.high + 1, size).astype(float)


class NormalLength(_LengthBase):
    """Normal, clipped to ``[min, max]`` (so the mean shifts if the clip bites)."""

    dist: Literal["normal"]
    mean: PositiveFloat
    std: float = Field(ge=0)

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return rng.normal(self.mean, self.std, size)


class LognormalLength(_LengthBase):
    """Lognormal given by its mean and either ``sigma`` (of the log) or its 99th percentile.

    With ``p99`` q and mean m: ln q = μ + z·σ and ln m = μ + σ²/2, so
    σ = z − sqrt(z² − 2·ln(q/m)) (the root with the percentile above the mean).
    """

    dist: Literal["lognormal"]
    mean: PositiveFloat
    # Past 20 (lengths spread over e^20, 5e8 times) the shape means nothing more, and
    # σ²/2 overflows a float long before σ does.
    sigma: float | None = Field(default=None, gt=0, le=20)
    p99: PositiveFloat | None = None

    @model_validator(mode="after")
    def _shape(self):  # type: ignore[no-untyped-def]
        if (self.sigma is None) == (self.p99 is None):
            raise ValueError("give exactly one of sigma or p99")
        if self.p99 is not None:
            ratio = math.log(self.p99 / self.mean)
            if ratio <= 0 or Z99 * Z99 - 2 * ratio < 0:
                most = self.mean * math.exp(Z99 * Z99 / 2)
                shown = f"{most:.0f}" if most < 1e15 else f"{most:.3g}"  # not 300 digits
                raise ValueError(
                    f"p99 ({self.p99}) must exceed the mean ({self.mean}) and be at most "
                    f"{shown} for a lognormal"
                )
        return self

    @property
    def log_sigma(self) -> float:
        if self.sigma is not None:
            return self.sigma
        assert self.p99 is not None
        return Z99 - math.sqrt(Z99 * Z99 - 2 * math.log(self.p99 / self.mean))

    @property
    def log_mu(self) -> float:
        return math.log(self.mean) - self.log_sigma**2 / 2

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return rng.lognormal(self.log_mu, self.log_sigma, size)


class ExponentialLength(_LengthBase):
    """Exponential with the given mean."""

    dist: Literal["exponential"]
    mean: PositiveFloat

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return rng.exponential(self.mean, size)


class ParetoLength(_LengthBase):
    """Pareto (type I) with shape ``alpha`` and minimum ``scale``: heavy-tailed lengths."""

    dist: Literal["pareto"]
    alpha: PositiveFloat
    scale: PositiveFloat

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return self.scale * (1.0 + rng.pareto(self.alpha, size))


class ZipfLength(_LengthBase):
    """Zipf-distributed integers (P(k) ∝ k^-a, a > 1) times ``scale``."""

    dist: Literal["zipf"]
    a: float = Field(gt=1)
    scale: PositiveFloat = 1.0

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        return rng.zipf(self.a, size) * self.scale


# The formats a trace file may have (workloads.importers reads them; kvsim: a table
# ``kvsim trace export`` wrote).
TraceFormat = Literal["azure", "burstgpt", "mooncake", "csv", "jsonl", "kvsim"]


class EmpiricalLength(_LengthBase):
    """Resampled (with replacement) from one column of a trace file.

    ``column`` names the column by its meaning, for a file whose format names it (Azure,
    BurstGPT, Mooncake, a kvsim trace table); ``file_column`` names it as the file does, for
    any CSV/JSONL. Each value must be an integer >= 1; a bad row is an error unless
    ``skip_invalid`` (then it is skipped, and the run's notes say how many).
    """

    dist: Literal["empirical"]
    path: str
    column: Literal["prompt_len", "output_len"] | None = None
    file_column: str | None = Field(
        default=None, min_length=1, description="the column's name in the file (its header "
        "in a CSV, its key in JSONL): reads any CSV/JSONL")
    format: TraceFormat | None = None
    skip_invalid: bool = False

    @model_validator(mode="after")
    def _one_column(self):  # type: ignore[no-untyped-def]
        if (self.column is None) == (self.file_column is None):
            raise ValueError("give column (prompt_len or output_len, in a file whose format "
                             "names them) or file_column (the column's name in the file), "
                             "one of the two")
        return self

    def raw(self, rng, size, base_dir):  # type: ignore[no-untyped-def]
        from workloads.importers import read_length_column

        values, _ = read_length_column(self, base_dir)
        return rng.choice(values, size).astype(float)

    def notes(self, base_dir: Path) -> list[str]:
        """What reading the file skipped (under ``skip_invalid``)."""
        from workloads.importers import read_length_column

        _, skipped = read_length_column(self, base_dir)
        return [f"empirical lengths from {self.path}: {note}" for note in skipped]


LengthDist = Annotated[
    ConstantLength
    | UniformLength
    | NormalLength
    | LognormalLength
    | ExponentialLength
    | ParetoLength
    | ZipfLength
    | EmpiricalLength,
    Field(discriminator="dist"),
]


# ---------------------------------------------------------------------- arrivals
class PoissonArrivals(ConfigModel):
    """Memoryless arrivals at ``rate`` requests/s (inter-arrival CV = 1)."""

    process: Literal["poisson"]
    rate: PositiveFloat

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.cumsum(rng.exponential(1.0 / self.rate, size))


class GammaArrivals(ConfigModel):
    """Gamma inter-arrivals: mean 1/rate, coefficient of variation ``cv`` (>1 is bursty)."""

    process: Literal["gamma"]
    rate: PositiveFloat
    # Beyond these the gamma's shape 1/cv² leaves a float (0 or infinite): between them,
    # from clockwork to nearly every request at once.
    cv: float = Field(ge=1e-6, le=1e6)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        shape = 1.0 / self.cv**2
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate * shape), size))


class ConstantArrivals(ConfigModel):
    """One request every 1/rate seconds, the first at t = 0."""

    process: Literal["constant"]
    rate: PositiveFloat

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return np.arange(size) / self.rate


class OnOffArrivals(ConfigModel):
    """Poisson at ``rate`` during ``on_s``-second bursts separated by ``off_s`` of silence."""

    process: Literal["onoff"]
    rate: PositiveFloat
    on_s: PositiveFloat = Field(le=MAX_TIME_S)
    off_s: float = Field(ge=0, le=MAX_TIME_S)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        active = np.cumsum(rng.exponential(1.0 / self.rate, size))
        return active + np.floor(active / self.on_s) * self.off_s


class ClosedLoopArrivals(ConfigModel):
    """``users`` clients, each sending its next request ``think_time_s`` (mean, exponential
    unless ``think_dist: constant``) after its previous one finished."""

    process: Literal["closed_loop"]
    users: PositiveInt
    think_time_s: float = Field(default=0.0, ge=0, le=MAX_TIME_S)
    think_dist: Literal["exponential", "constant"] = "exponential"

    def think(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.think_dist == "constant" or self.think_time_s == 0:
            return np.full(size, self.think_time_s)
        return rng.exponential(self.think_time_s, size)


class TraceArrivals(ConfigModel):
    """The trace's own timestamps, replayed ``speed`` times faster (2 = twice the rate).

    A session's later turns wait on the turn before and then its recorded think time (in a
    kvsim trace table); ``scale_think`` shortens those by ``speed`` too, as if the whole
    recording were played faster, where by default users think as long as they did.
    """

    process: Literal["trace"]
    speed: PositiveFloat = 1.0
    scale_think: bool = False


OpenArrivals = Annotated[
    PoissonArrivals | GammaArrivals | ConstantArrivals | OnOffArrivals,
    Field(discriminator="process"),
]
SyntheticArrivals = Annotated[
    PoissonArrivals | GammaArrivals | ConstantArrivals | OnOffArrivals | ClosedLoopArrivals,
    Field(discriminator="process"),
]


# ---------------------------------------------------------------------- priorities
PRIORITY_STREAM = 0x5052494F  # a random stream of its own: other draws stay as they were


def draw_priorities(mix: dict[int, float], session_id: np.ndarray, seed: int) -> np.ndarray:
    """Each request's priority level, drawn with probability proportional to its weight in
    ``mix``; the turns of a session (or a closed-loop user's requests) share one draw."""
    levels = np.array(sorted(mix), dtype=np.int64)
    weights = np.array([mix[level] for level in sorted(mix)], dtype=float)
    rng = np.random.default_rng([seed, PRIORITY_STREAM])
    size = len(session_id)
    sessions = int(session_id.max()) + 1 if size else 0
    draws = rng.choice(levels, size=sessions + size, p=weights / weights.sum())
    # Sessions first, then a draw of its own for each request outside any session.
    keys = np.where(session_id >= 0, session_id, sessions + np.arange(size))
    return draws[keys]
