"""The ``workload:`` section of a scenario: a synthetic recipe or a public trace to import."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, PositiveFloat, PositiveInt, Tag, model_validator

from workloads.distributions import (
    MAX_LENGTH,
    MAX_TIME_S,
    ConfigModel,
    EmpiricalLength,
    LengthDist,
    OpenArrivals,
    SyntheticArrivals,
    TraceArrivals,
    TraceFormat,
)

# The most requests a trace holds (stop.num_requests; a duration's synthetic stream stops
# drawing past it), and the most shared prompts a recipe draws from: beyond these the
# arrays alone outgrow any machine, and the run would take days.
MAX_REQUESTS = 50_000_000
MAX_SHARED_PROMPTS = 1_000_000
# The most sequences (samples, beams) one request runs together: a scheduler numbers them
# request × MAX_SAMPLES + sample.
MAX_SAMPLES = 256


class PrefixGroups(ConfigModel):
    """G shared system prompts of ``length`` tokens; a ``fraction`` of requests start with one,
    chosen with Zipf popularity (P(group k) ∝ 1/k^zipf_s; 0 = uniform)."""

    groups: PositiveInt = Field(le=MAX_SHARED_PROMPTS)
    length: PositiveInt
    fraction: float = Field(default=1.0, ge=0, le=1)
    zipf_s: float = Field(default=1.0, ge=0)


class FewShot(ConfigModel):
    """Few-shot prompting: ``templates`` fixed sets of ``shots`` examples of ``shot_len``
    tokens each (after any system prompt); a ``fraction`` of requests use one (Zipf)."""

    templates: PositiveInt = Field(default=1, le=MAX_SHARED_PROMPTS)
    shots: PositiveInt
    shot_len: PositiveInt
    fraction: float = Field(default=1.0, ge=0, le=1)
    zipf_s: float = Field(default=1.0, ge=0)


class Sessions(ConfigModel):
    """Multi-turn chat: each turn's prompt is every earlier prompt and answer plus new user
    text, sent ``think_time_s`` (exponential mean) after the previous answer completes."""

    turns: LengthDist
    think_time_s: float = Field(default=5.0, ge=0, le=MAX_TIME_S)
    user_len: LengthDist | None = None


class Sampling(ConfigModel):
    """Parallel samples per request. Beam search of width w is modelled as w forks sharing the
    prompt (no re-forking of partial beams)."""

    n: PositiveInt = 1
    beam_width: PositiveInt = 1

    @property
    def forks(self) -> int:
        return max(self.n, self.beam_width)


PRIORITIES_DESCRIPTION = (
    "priority levels and their weights, e.g. {0: 0.2, 1: 0.8}: each request (each session, "
    "each closed-loop user) draws its level; lower is served first under scheduler.policy: "
    "priority, as vLLM's")
Priorities = Annotated[dict[int, PositiveFloat] | None,
                       Field(default=None, min_length=1, description=PRIORITIES_DESCRIPTION)]
QUEUE_TIMEOUT_DESCRIPTION = (
    "seconds a client waits for its request to be seated before it cancels it (a client's "
    "time-out): the request leaves the queue unserved, counted as abandoned and missing "
    "every SLO; one seated once is never cancelled; absent: clients wait for ever")
QueueTimeout = Annotated[PositiveFloat | None,
                         Field(default=None, description=QUEUE_TIMEOUT_DESCRIPTION)]
TTFT_TIMEOUT_DESCRIPTION = (
    "seconds a streaming client waits for its request's first token before it disconnects: "
    "waiting, seated while its prompt is read, or preempted before its first token, the "
    "request is aborted (its KV freed at the next step boundary, as vLLM does when a client "
    "goes away), counted as abandoned and missing every SLO; absent: clients wait for ever")
TtftTimeout = Annotated[PositiveFloat | None,
                        Field(default=None, description=TTFT_TIMEOUT_DESCRIPTION)]
E2E_TIMEOUT_DESCRIPTION = (
    "seconds a client that waits for the whole answer (no streaming) gives its request "
    "before it gives up: waiting, seated while its prompt is read or while its answer is "
    "generated, or preempted, the request is aborted (its KV freed at the next step "
    "boundary), counted as abandoned and missing every SLO, the tokens generated for it "
    "wasted; absent: clients wait for ever")
E2eTimeout = Annotated[PositiveFloat | None,
                       Field(default=None, description=E2E_TIMEOUT_DESCRIPTION)]
ITL_TIMEOUT_DESCRIPTION = (
    "seconds a streaming client waits for its next token once it has had one before it "
    "disconnects (a read time-out between two chunks, as nginx's proxy_read_timeout or "
    "httpx's read timeout): preempted, handed to a decode replica, or stalled behind a step "
    "that long, the request is aborted (its KV freed at the next step boundary), counted as "
    "abandoned and missing every SLO, the tokens generated for it wasted; absent: clients "
    "wait for ever")
ItlTimeout = Annotated[PositiveFloat | None,
                       Field(default=None, description=ITL_TIMEOUT_DESCRIPTION)]


def clients_time_out(workload: SyntheticWorkload | TraceWorkload) -> bool:
    """Whether the workload's clients give up on requests (any of its time-outs is set)."""
    return any(timeout is not None for timeout in (
        workload.queue_timeout_s, workload.ttft_timeout_s, workload.e2e_timeout_s,
        workload.itl_timeout_s))


class Retry(ConfigModel):
    """What a client whose request timed out (``queue_timeout_s``, ``ttft_timeout_s``,
    ``e2e_timeout_s``, ``itl_timeout_s``) or was turned away by a full line (a system's
    ``scheduler.max_queued_requests``) does next: it sends the request again, up to
    ``max_retries`` times, waiting ``backoff_s`` before the first retry and twice as long
    before each next one, at most ``max_backoff_s``, each wait shortened by up to a
    ``jitter`` share at random so that clients who gave up together do not all come back
    together: the OpenAI Python client's defaults. Each retry passes the balancer again, a
    new request to it (the engine routes it)."""

    max_retries: PositiveInt = Field(default=2, le=100)
    backoff_s: float = Field(default=0.5, ge=0, le=MAX_TIME_S)
    max_backoff_s: float = Field(default=8.0, ge=0, le=MAX_TIME_S)
    jitter: float = Field(default=0.25, ge=0, le=1)

    def delay_s(self, retry: int, draw: float) -> float:
        """Seconds between a time-out (or a refusal) and retry number ``retry`` (1 for the
        first), for a uniform ``draw`` in [0, 1)."""
        return min(self.backoff_s * 2.0 ** (retry - 1), self.max_backoff_s) * (
            1.0 - self.jitter * draw)


class SyntheticWorkload(ConfigModel):
    """Requests drawn from distributions: arrivals, lengths, shared content, sampling.

    ``prompt_len`` is each request's own text; a system prompt or few-shot template is
    added in front of it. ``max_tokens`` defaults to the output distribution's ``max`` (or the
    model's context limit): what a ``request_max`` reservation must cover.
    """

    kind: Literal["synthetic"] = "synthetic"
    arrival: SyntheticArrivals
    prompt_len: LengthDist
    output_len: LengthDist
    max_tokens: PositiveInt | None = Field(default=None, le=MAX_LENGTH)
    prefix_groups: PrefixGroups | None = None
    few_shot: FewShot | None = None
    sessions: Sessions | None = None
    sampling: Sampling = Sampling()
    priorities: Priorities = None
    queue_timeout_s: QueueTimeout = None
    ttft_timeout_s: TtftTimeout = None
    e2e_timeout_s: E2eTimeout = None
    itl_timeout_s: ItlTimeout = None
    retry: Retry | None = None

    @model_validator(mode="after")
    def _closed_loop_without_sessions(self):  # type: ignore[no-untyped-def]
        if self.sessions is not None and self.arrival.process == "closed_loop":
            raise ValueError("sessions and a closed_loop arrival process cannot be combined")
        return self

    def length_notes(self, base_dir: Path) -> list[str]:
        """What the empirical length distributions skipped in their files."""
        dists: list[LengthDist | None] = [self.prompt_len, self.output_len]
        if self.sessions is not None:
            dists += [self.sessions.turns, self.sessions.user_len]
        notes = [note for dist in dists if isinstance(dist, EmpiricalLength)
                 for note in dist.notes(base_dir)]
        return list(dict.fromkeys(notes))  # one file read by two distributions: one note

    def context_problem(self, max_model_len: int) -> str | None:
        """Why the shared prefixes leave a request no room in the model's context, or None
        (a request needs a token of its own and one generated)."""
        shared = [(f"prefix_groups.length {self.prefix_groups.length}",
                   self.prefix_groups.length)] if self.prefix_groups else []
        if self.few_shot:
            shared.append((f"few_shot.shots × shot_len {self.few_shot.shots} × "
                           f"{self.few_shot.shot_len}",
                           self.few_shot.shots * self.few_shot.shot_len))
        shared_len = sum(tokens for _, tokens in shared)
        if shared_len < max_model_len - 1:
            return None
        return (f"workload.{' + '.join(what for what, _ in shared)}: shared prefixes of "
                f"{shared_len} tokens leave no room in the model's context of "
                f"{max_model_len}; expected fewer than {max_model_len - 1}")


class ColumnMap(ConfigModel):
    """Which columns of a generic CSV/JSONL file hold what."""

    arrival: str
    prompt_len: str
    output_len: str
    hash_ids: str | None = Field(
        default=None, description="prompt-block hash ids, Mooncake-style: a JSON list of "
        "integers (in a CSV cell, its text), each naming hash_block_tokens tokens; equal ids "
        "are shared content")
    priority: str | None = Field(default=None, description="integer scheduling priority, "
                                 "lower first")
    predicted_output: str | None = Field(
        default=None, description="the output length a predictor expected for the request "
        "(integer >= 1), for a system whose predictor has source: trace")
    max_tokens: str | None = Field(
        default=None, description="the max_tokens the client asked for (an integer, at "
        "least the row's output length): what a request_max reservation holds for the "
        "request, within workload.max_tokens and the context limit (absent: those limits)")


class TraceWorkload(ConfigModel):
    """A trace file: Azure LLM inference (2023/2024) CSV, BurstGPT CSV, Mooncake JSONL, a
    generic CSV/JSONL with a ``columns`` map, or a table ``kvsim trace export`` wrote (format
    ``kvsim``: replayed exactly, sessions and shared prefixes included).

    ``path`` is relative to the scenario file; ``builtin:NAME`` names a trace shipped with
    kvsim (``kvsim trace list``). Bad rows stop the import with the file, row and column,
    unless ``skip_invalid: true`` (then they are skipped, counted and reported).
    """

    kind: Literal["trace"] = "trace"
    path: str
    format: TraceFormat | None = None
    columns: ColumnMap | None = None
    time_unit: Literal["s", "ms", "us", "datetime"] | None = None
    arrival: Annotated[
        TraceArrivals | OpenArrivals, Field(discriminator="process")
    ] = TraceArrivals(process="trace")
    skip_invalid: bool = False
    hash_block_tokens: PositiveInt = 512
    max_tokens: PositiveInt | None = Field(default=None, le=MAX_LENGTH)
    sampling: Sampling = Sampling()
    priorities: Priorities = None
    queue_timeout_s: QueueTimeout = None
    ttft_timeout_s: TtftTimeout = None
    e2e_timeout_s: E2eTimeout = None
    itl_timeout_s: ItlTimeout = None
    retry: Retry | None = None

    @model_validator(mode="after")
    def _generic_needs_columns(self):  # type: ignore[no-untyped-def]
        if self.format == "kvsim" and (self.columns is not None
                                       or self.time_unit not in (None, "s")):
            raise ValueError("format kvsim (a table kvsim trace export wrote) names its own "
                             "columns, times in seconds: give no columns or time_unit")
        if self.format in ("csv", "jsonl") and self.columns is None:
            raise ValueError(f"format {self.format} needs a columns map (arrival, prompt_len, "
                             "output_len)")
        if self.priorities is not None and self.columns is not None and (
                self.columns.priority is not None):
            raise ValueError("give priorities or columns.priority, not both: the trace's own "
                             "priorities or drawn ones")
        return self


def _workload_kind(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("kind") or ("trace" if "path" in value else "synthetic")
    return getattr(value, "kind", "synthetic")


Workload = Annotated[
    Annotated[SyntheticWorkload, Tag("synthetic")] | Annotated[TraceWorkload, Tag("trace")],
    Discriminator(_workload_kind),
]
