"""The SimPy engine: arrivals, one engine process per replica, and time.

Think of a railway timetable. Requests arrive on their own schedule (an arrival process per
replica wakes the engine when a train comes in to an empty station); each replica's engine
process loops *schedule → step → advance the clock*. Between two events nothing changes but
context lengths, so a run of identical decode steps is advanced in one jump — ending at the
earliest of the next arrival, the next completion, or the first block boundary the pool
cannot cover — with exactly the clock values stepping would give (``engine.mode: step``
keeps the one-step-at-a-time loop to test that).

Requests that wait on another (closed loops, session turns) are released ``think_s`` after
it finishes; they always run on the replica of the request they wait on, so every release
happens at one of that replica's own event times. Open arrivals go round-robin, assigned up
front, or through a load- or cache-aware :class:`~sim.router.Router`, which routes each one
when the first replica's clock reaches it; replicas then also stop at every open arrival.

The data-parallel ranks of a mixture of experts are replicas that cannot keep their own
time: their MoE layers exchange tokens, so one process drives an engine's ranks through
rounds, like carriages coupled into one train, each round as long as its slowest rank's
step (:class:`_RankGroup`).

Pipeline stages are stations down one line: a batch leaves the first stage for the next as
soon as that stage is done with it, and the first takes the next batch, so as many batches
as stages are in flight, each of its own requests, through the stages in order
(:meth:`_Replica.run_pipeline`).
"""

from __future__ import annotations

import gc
import heapq
import json
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pandas as pd
import simpy

from sim.length_predictor import predicted_output_lengths
from sim.memory import (
    ContiguousAllocator,
    HybridPagedAllocator,
    KVAllocator,
    MemorySnapshot,
    PagedAllocator,
    final_kv_tokens,
)
from sim.presets import (
    GIB,
    KV_CACHE_DTYPE_BYTES,
    MIB,
    ModelSpec,
    SizingError,
    kv_pool_slots,
    max_concurrency,
)
from sim.results import (
    HANDOVER_COLUMNS,
    MEMORY_COLUMNS,
    MEMORY_TABLE_COLUMNS,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    RunResult,
    ScenarioResult,
    summarize,
    token_wait_summary,
)
from sim.router import CacheEvents, Router
from sim.scenario import (
    ContiguousConfig,
    PagedConfig,
    Scenario,
    ScenarioError,
    SpeculativeConfig,
    SystemConfig,
    VirtualConfig,
    uses_hybrid_kv_cache,
)
from sim.scheduler import Batch, QuietDecode, Request, Scheduler, Siblings, WaitingLine
from sim.timing import (
    Calibration,
    CalibrationError,
    StepTimeModel,
    pipeline_hop_s_per_token,
    roofline,
    state_write_s,
    with_transfer,
)
from workloads import Trace, TraceError, WorkloadError, build_trace
from workloads.distributions import MAX_TIME_S
from workloads.spec import MAX_REQUESTS, MAX_SAMPLES, SyntheticWorkload, clients_time_out


class SimulationError(RuntimeError):
    """The simulation reached a state it cannot leave (a bug, or an impossible setting)."""


def allocation_unit(scenario: Scenario, system: SystemConfig) -> int:
    """Token slots a system's memory is handed out in: a paged block, the tokens one page of
    virtual memory holds (vAttention), or 1 (a contiguous extent may have any size)."""
    cfg = system.allocator
    if isinstance(cfg, VirtualConfig):
        model = scenario.model_spec()
        tokens = model.tokens_per_page(cfg.page_kib * 1024,
                                       scenario.parallel.tensor_parallel_size)
        if tokens < 1:
            raise SizingError(f"systems[{system.name}].allocator.page_kib: a {cfg.page_kib} "
                              f"KiB page holds not one token of one layer's K for {model.name}")
        return tokens
    if not isinstance(cfg, PagedConfig):
        return 1
    # A state-space hybrid's blocks hold a sequence's state in a layer group: vLLM raises
    # the block size to fit it (to whole Mamba-2 chunks under mamba cache mode all).
    return max(cfg.block_size, cached_model(scenario, system).state_block_size(
        scenario.parallel.tensor_parallel_size, caches_every_state(system)))


def caches_every_state(system: SystemConfig) -> bool:
    """Whether ``system`` keeps a state-space hybrid's state at every block boundary
    (vLLM's mamba cache mode all), not only where steps end (align)."""
    cfg = system.allocator
    return (isinstance(cfg, PagedConfig) and cfg.prefix_caching
            and cfg.mamba_cache_mode == "all")


def cached_model(scenario: Scenario, system: SystemConfig) -> ModelSpec:
    """The layers ``system``'s KV cache is laid out for: the scenario's model, and, for a
    state-space hybrid or under the hybrid KV cache manager, an MTP or EAGLE drafter's
    attention layers among them and the states grown for its drafts
    (:meth:`~sim.presets.ModelSpec.with_speculation`), as vLLM groups them. Elsewhere a
    drafter's KV is its share of every slot (:func:`system_pool_slots`)."""
    model = scenario.model_spec()
    spec = system.speculative
    if spec is None or spec.draft_model is not None or not (
            model.has_state_layers or uses_hybrid_kv_cache(model, system)):
        return model
    return model.with_speculation(spec.drafter_layers, spec.num_speculative_tokens)


def states_per_sequence(system: SystemConfig) -> int:
    """States a sequence keeps in each state-space layer: one, and under speculative
    decoding one for each draft position (vLLM's ``num_speculative_blocks``), as the
    kernel writes the state after every draft to keep the accepted one's."""
    spec = system.speculative
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def extent_state_slots(model: ModelSpec, system: SystemConfig,
                       tensor_parallel_size: int) -> int:
    """Slots a contiguous extent of ``system`` holds for its sequence's states: every state
    layer's, as many times as :func:`states_per_sequence` says."""
    return states_per_sequence(system) * model.state_slots_per_sequence(tensor_parallel_size)


def kv_bytes_per_slot(scenario: Scenario, system: SystemConfig) -> float:
    """Bytes one of ``system``'s pool slots takes on each GPU: a token of every attention
    layer, a drafter's KV with it (:func:`system_pool_slots`); under the hybrid KV cache
    manager a token of one group's layers, the drafter's among them where they join the
    groups (:func:`cached_model`)."""
    model = scenario.model_spec()
    per_token = (model.kv_bytes_per_token_per_gpu(scenario.parallel.tensor_parallel_size)
                 + drafter_memory(scenario, system)[1])
    kv_model = cached_model(scenario, system)
    if not uses_hybrid_kv_cache(kv_model, system):
        return float(per_token)
    # The pool's bytes make as many group slots as build_allocator counts blocks for.
    return per_token * kv_model.kv_cache_groups()[0] / kv_model.kv_layers


def build_allocator(system: SystemConfig, pool_slots: int, max_model_len: int,
                    host_slots: int = 0, page_tokens: int = 0,
                    model: ModelSpec | None = None,
                    tensor_parallel_size: int = 1) -> KVAllocator:
    """The allocator a system describes, over ``pool_slots`` token slots (and a host tier of
    ``host_slots`` if it has one); a virtual-memory system maps ``page_tokens`` at a time,
    a paged one holds that many a block where given (see :func:`allocation_unit`). A
    ``model`` with sliding-window or state-space layers gets the hybrid manager's groups
    where the system uses it, and its state space on each GPU of a
    ``tensor_parallel_size`` group."""
    cfg = system.allocator
    if model is not None and uses_hybrid_kv_cache(model, system):
        assert isinstance(cfg, PagedConfig)
        block_size = page_tokens or cfg.block_size
        group_layers, full_groups, sliding_groups, state_groups = model.kv_cache_groups()
        # A block holds block_size tokens of one group's layers.
        num_blocks = pool_slots * model.kv_layers // (group_layers * block_size)
        if num_blocks < 1:
            raise SizingError(f"systems[{system.name}]: the KV pool ({pool_slots} slots) is "
                              f"smaller than one block of {group_layers} layers")
        scheduler = system.scheduler
        return HybridPagedAllocator(
            num_blocks, block_size, full_groups=full_groups,
            sliding_groups=sliding_groups, sliding_window=model.sliding_window,
            prefill_chunk_tokens=(scheduler.prefill_chunk_tokens
                                  if scheduler.chunked_prefill else None),
            enable_prefix_caching=cfg.prefix_caching, eviction=cfg.eviction,
            watermark=cfg.watermark, state_groups=state_groups,
            state_slots=model.state_tokens_per_layer(tensor_parallel_size) or None,
            states_per_group=states_per_sequence(system),
            cache_every_state=caches_every_state(system))
    if isinstance(cfg, ContiguousConfig):
        return ContiguousAllocator(
            pool_slots, max_model_len=max_model_len, reserve_policy=cfg.reserve_policy,
            placement=cfg.placement,
            state_slots=0 if model is None else extent_state_slots(
                model, system, tensor_parallel_size))
    if isinstance(cfg, VirtualConfig):
        # Physical pages on demand, exactly as blocks are; no sharing between requests.
        if page_tokens < 1:
            raise ValueError("a virtual-memory system needs the tokens a page holds")
        return PagedAllocator(pool_slots // page_tokens, page_tokens,
                              enable_prefix_caching=False, watermark=cfg.watermark)
    if pool_slots < cfg.block_size:
        raise SizingError(f"systems[{system.name}]: the KV pool ({pool_slots} slots) is smaller "
                          f"than one block ({cfg.block_size} slots)")
    return PagedAllocator(pool_slots // cfg.block_size, cfg.block_size,
                          enable_prefix_caching=cfg.prefix_caching, eviction=cfg.eviction,
                          watermark=cfg.watermark,
                          host_cache_blocks=host_slots // cfg.block_size)


def host_memory(scenario: Scenario, system: SystemConfig) -> tuple[int, int, float]:
    """A system's host memory per replica: the token slots of its host cache and of its
    swap space, and the seconds one token's KV takes to cross each GPU's PCIe link (the GPUs
    of a tensor-parallel group move their shares side by side). Zeros where it uses none."""
    tp = scenario.parallel.tensor_parallel_size
    cache_gib = getattr(system.allocator, "host_cache_gib", 0)
    swap = system.scheduler.swaps
    if not cache_gib and not swap:
        return 0, 0, 0.0
    link = scenario.gpu_spec().host_link_bytes_per_s
    if not link:  # the scenario refuses this; a GpuSpec built by hand may still lack it
        raise SizingError(f"systems[{system.name}]: host memory (a host cache, or swap) needs "
                          "the GPU's host link bandwidth")
    # A host slot keeps what a pool slot holds (a drafter's KV with the target's), each
    # GPU's share of it in the memory beside that GPU.
    slot_bytes = kv_bytes_per_slot(scenario, system)

    def slots_in(gib: float) -> int:
        return int(gib * GIB // (slot_bytes * tp))

    # vLLM's --swap-space is per GPU; a tensor-parallel group swaps each GPU's share.
    swap_slots = slots_in(system.scheduler.swap_space_gib * tp) if swap else 0
    return slots_in(cache_gib), swap_slots, slot_bytes / link


def load_calibration(file: str, base_dir: Path, model: ModelSpec, scenario: Scenario,
                     field: str, runs: str, step_overhead_s: float) -> StepTimeModel:
    """The step-time model of ``file`` (relative to ``base_dir``), the scenario's ``field``,
    refused unless it timed ``model`` (which the scenario ``runs``, as the message says) on
    as many GPUs and the same KV cache dtype."""
    path = Path(file)
    path = path if path.is_absolute() else base_dir / path
    if not path.exists():
        raise CalibrationError(f"{path}: calibration file not found ({field})")
    calibration = Calibration.load(path)
    if calibration.model != model.name:
        raise CalibrationError(f"{path}: model: calibrated for {calibration.model!r}, but "
                               f"{runs} {model.name!r}")
    tp = scenario.parallel.tensor_parallel_size
    if calibration.tensor_parallel_size != tp:
        raise CalibrationError(
            f"{path}: tensor_parallel_size: calibrated on {calibration.tensor_parallel_size} "
            f"GPU(s), but the scenario runs parallel.tensor_parallel_size {tp}")
    kv_dtype = scenario.memory.kv_cache_dtype
    if KV_CACHE_DTYPE_BYTES.get(calibration.kv_cache_dtype) != KV_CACHE_DTYPE_BYTES.get(
            kv_dtype):
        raise CalibrationError(
            f"{path}: kv_cache_dtype: timed with kv_cache_dtype "
            f"{calibration.kv_cache_dtype}, but the scenario's memory.kv_cache_dtype is "
            f"{kv_dtype}, whose attention reads a different number of bytes per token "
            f"(drop {field} to use the roofline)")
    return calibration.to_model(str(path), step_overhead_s)


def build_timing(scenario: Scenario, base_dir: Path) -> StepTimeModel:
    """Roofline of the model on the GPU, or the scenario's calibration file."""
    model = scenario.model_spec()
    if scenario.timing.calibration:
        calibrated = load_calibration(
            scenario.timing.calibration, base_dir, model, scenario, "timing.calibration",
            "the scenario runs", scenario.timing.step_overhead_s)
        if model.has_state_layers:  # the part of the measured b that is the states' traffic
            calibrated = replace(calibrated, state_s=min(calibrated.b, 2.0 * state_write_s(
                model, scenario.gpu_spec(), scenario.parallel.tensor_parallel_size)))
        return with_sliding_window(calibrated, model)
    parallel = scenario.parallel
    base = roofline(model, scenario.gpu_spec(), scenario.timing.step_overhead_s,
                    tensor_parallel_size=parallel.tensor_parallel_size,
                    data_parallel_size=parallel.data_parallel_size,
                    expert_parallel=parallel.expert_parallel,
                    expert_load_imbalance=parallel.expert_load_imbalance,
                    allreduce_latency_s=parallel.allreduce_latency_s)
    return with_sliding_window(replace(base, paged_alpha=scenario.timing.paged_alpha), model)


def with_speculation(timing: StepTimeModel, scenario: Scenario, system: SystemConfig,
                     base_dir: Path = Path()) -> StepTimeModel:
    """The step-time model of a system that decodes speculatively: its drafts in every
    decode step, and its drafter's passes: a share of the target's layers (EAGLE, MTP), or
    the roofline on the same GPUs of a draft model or a dense EAGLE head, or a draft
    model's calibration (``draft_calibration``, relative to ``base_dir``; no step overhead
    of its own: its passes run inside the step)."""
    spec = system.speculative
    if spec is None:
        return timing
    drafter: StepTimeModel | None = None
    model = scenario.model_spec()
    draft = spec.drafter_spec(model)
    if draft is not None and spec.draft_calibration:
        field = f"systems[{system.name}].speculative"
        drafter = load_calibration(spec.draft_calibration, base_dir, draft, scenario,
                                   f"{field}.draft_calibration", f"{field}.draft_model is", 0.0)
    elif draft is not None:
        drafter = roofline(draft, scenario.gpu_spec(), 0.0,
                           tensor_parallel_size=scenario.parallel.tensor_parallel_size,
                           allreduce_latency_s=scenario.parallel.allreduce_latency_s)
    elif spec.drafter_layers:
        drafter = timing.share(spec.drafter_layers / model.num_layers,
                               f"{spec.method} drafter: {spec.drafter_layers} of "
                               f"{model.num_layers} layers of {timing.source}",
                               spec.drafter_layers / model.kv_layers)
    if model.has_state_layers:
        # Every state grows for the drafts (the step reads and writes it whole), and each
        # draft writes one more.
        gpu, tp = scenario.gpu_spec(), scenario.parallel.tensor_parallel_size
        write_s = state_write_s(cached_model(scenario, system), gpu, tp)
        grown_s = 2.0 * (write_s - state_write_s(model, gpu, tp))
        timing = replace(timing, b=timing.b + grown_s, state_s=timing.state_s + grown_s,
                         draft_state_s=write_s)
    return replace(timing, speculative_tokens=spec.num_speculative_tokens, drafter=drafter)


# Batch sizes an auto schedule chooses K for one by one; larger ones keep the last K.
AUTO_SCHEDULE_MAX_BATCH = 4096


def best_draft_schedule(timings: dict[int, StepTimeModel], spec: SpeculativeConfig,
                        context_tokens: float, rho: float, max_batch: int
                        ) -> list[tuple[int, int, int]]:
    """K by batch size, as ``[lo, hi, K]`` ranges: for every batch size up to ``max_batch``
    the K (of ``timings``' keys) whose decode step keeps the most tokens a second, τ(K) over
    the time of a step of that many sequences, each reading ``context_tokens`` and its
    drafts; the fewer drafts where two tie. vLLM's dynamic speculation chooses so from step
    times it profiled; here the step-time model (a roofline or a calibration) gives them."""
    rates = {drafts: float(spec.tokens_per_step_with(drafts)) for drafts in timings}
    schedule: list[tuple[int, int, int]] = []
    for size in range(1, min(max_batch, AUTO_SCHEDULE_MAX_BATCH) + 1):
        def tokens_per_s(drafts: int, size: int = size) -> tuple[float, int]:
            step_s = timings[drafts].step_time(
                size, round(size * (context_tokens + 1 + drafts)), 0, 0, rho)
            return rates[drafts] / step_s, -drafts

        best = max(timings, key=tokens_per_s)
        if schedule and schedule[-1][2] == best:
            schedule[-1] = (schedule[-1][0], size, best)
        else:
            schedule.append((size, size, best))
    return schedule


def drafter_memory(scenario: Scenario, system: SystemConfig) -> tuple[float, float]:
    """What a system's speculative drafter holds on each GPU: its weights' bytes, and the
    bytes of KV it keeps for every token (0, 0 for n-gram lookup or no speculation)."""
    spec = system.speculative
    if spec is None:
        return 0.0, 0.0
    model = scenario.model_spec()
    tp = scenario.parallel.tensor_parallel_size
    draft = spec.drafter_spec(model)
    if draft is not None:
        kv_dtype = scenario.memory.kv_cache_dtype
        if KV_CACHE_DTYPE_BYTES.get(kv_dtype):  # the cache's dtype is the drafter's too
            draft = replace(draft, kv_dtype_bytes=KV_CACHE_DTYPE_BYTES[kv_dtype])
        return draft.weight_bytes / tp, float(draft.kv_bytes_per_token_per_gpu(tp))
    share = spec.drafter_layers / model.num_layers
    weight_bytes = model.weight_bytes_per_gpu(tp, scenario.parallel.stage_gpus)
    # Its layers attend: each caches what one of the target's attention layers does.
    kv_share = spec.drafter_layers / model.kv_layers
    return share * weight_bytes, kv_share * model.kv_bytes_per_token_per_gpu(tp)


def system_pool_slots(scenario: Scenario, system: SystemConfig) -> int:
    """Token slots in one replica's KV pool for ``system``: the scenario's, less what a
    speculative drafter takes: its weights out of GPU memory (unless the pool's size is
    given), and its KV in every slot (vLLM keeps the drafter's layers in the same cache)."""
    slots = scenario_pool_slots(scenario)
    weight_bytes, kv_bytes = drafter_memory(scenario, system)
    if not kv_bytes:
        return slots
    per_token = scenario.model_spec().kv_bytes_per_token_per_gpu(
        scenario.parallel.tensor_parallel_size)
    pool_bytes: float = slots * per_token
    if scenario.memory.kv_memory_gib is None:
        pool_bytes -= weight_bytes
    return max(0, int(pool_bytes // (per_token + kv_bytes)))


def with_sliding_window(timing: StepTimeModel, model: ModelSpec) -> StepTimeModel:
    """The step-time model for ``model``'s sliding-window layers, which read at most a
    window of each context (roofline or calibration alike: those layers do less)."""
    if not model.sliding_window:
        return timing
    return replace(timing, sliding_share=model.num_sliding_layers / model.num_layers)


class _RowBuffer:
    """A table filled one row at a time, held as typed column chunks rather than tuples.

    A long run appends millions of rows; as Python tuples they cost several times their
    numbers. Every ``chunk_rows`` rows become a DataFrame chunk: times float, counts int,
    unless ``dtypes`` says otherwise.
    """

    def __init__(self, columns: list[str], dtypes: dict[str, type] | None = None,
                 chunk_rows: int = 1 << 16) -> None:
        self.columns = columns
        self.chunk_rows = chunk_rows
        self.dtypes: dict[str, type] = {c: float if c.endswith("_s") else np.int64
                                        for c in columns}
        self.dtypes.update(dtypes or {})
        self._rows: list[tuple] = []
        self._chunks: list[pd.DataFrame] = []

    def append(self, row: tuple) -> None:
        self._rows.append(row)
        if len(self._rows) >= self.chunk_rows:
            self._flush()

    def _flush(self) -> None:
        self._chunks.append(pd.DataFrame(self._rows, columns=self.columns).astype(self.dtypes))
        self._rows = []

    def frame(self) -> pd.DataFrame:
        """All rows so far, in order (an empty typed frame when there are none)."""
        if self._rows or not self._chunks:
            self._flush()
        if len(self._chunks) > 1:
            self._chunks = [pd.concat(self._chunks, ignore_index=True)]
        return self._chunks[0]


@dataclass
class _Recorder:
    """Collects one system's step log and memory samples, and their time integrals."""

    sample_interval_s: float

    def __post_init__(self) -> None:
        self.steps = _RowBuffer(list(STEP_COLUMNS))
        self.memory = _RowBuffer(list(MEMORY_TABLE_COLUMNS))
        self.weighted = dict.fromkeys((*MEMORY_COLUMNS, "running"), 0.0)
        self.weight = 0.0
        self._last_sample = -math.inf

    def record(self, replica: int, start_s: float, duration_s: float, steps: int, batch: Batch,
               sched: Scheduler, snap: MemorySnapshot, quiet: QuietDecode | None,
               finished: int, pool_scale: float = 1.0,
               peers: list[Scheduler] | None = None) -> None:
        """One step, or a run of ``quiet`` decode steps, that began holding ``snap`` and
        ended with ``finished`` requests done (or aborted); its slots count ``pool_scale``
        times in the averages (a pool's slots in those of the pool the summary is of). Under
        pipeline parallelism ``peers`` are the schedulers of every batch, whose requests
        count."""
        running, waiting = len(sched.running), len(sched.waiting)
        if peers is not None:
            running = sum(len(peer.running) for peer in peers)
        self.steps.append((replica, start_s, duration_s, steps, batch.decode_seqs,
                           batch.draft_tokens, batch.context_tokens, batch.prefill_tokens,
                           len(batch.prefill),
                           batch.loaded_tokens, batch.swapped_slots, batch.preempted, running,
                           waiting))
        # What each step held for as long as it ran, and the requests running after it.
        last_step_s = duration_s
        if quiet is None:
            for key, slots in zip(MEMORY_COLUMNS, snap, strict=True):
                self.weighted[key] += duration_s * slots * pool_scale
        else:
            for key, slot_s in zip(MEMORY_COLUMNS, quiet.slot_seconds, strict=True):
                self.weighted[key] += slot_s * pool_scale
            last_step_s = quiet.last_step_s  # the finishes came at its end
        self.weighted["running"] += (duration_s - last_step_s) * (running + finished) + (
            last_step_s * running)
        self.weight += duration_s
        if start_s - self._last_sample >= self.sample_interval_s:
            self._last_sample = start_s
            counted = peers or [sched]
            self.memory.append((replica, start_s, *snap, running, waiting, batch.decode_seqs,
                                sum(s.num_preemptions for s in counted),
                                sum(s.hit_tokens for s in counted),
                                sum(s.lookup_tokens for s in counted)))

    def averages(self) -> dict[str, float]:
        """Slots of each kind and running requests per replica, averaged over the time the
        replicas spent in steps (each replica's steps weighted by their durations, so the
        time of every replica counts once)."""
        weight = self.weight or 1.0
        return {k: v / weight for k, v in self.weighted.items()}


class _Replica:
    """One engine instance: a scheduler over its own allocator, driven by SimPy."""

    def __init__(self, env: simpy.Environment, index: int, sim: _SystemRun,
                 allocator: KVAllocator, setup: _RoleSetup, role: str = "both") -> None:
        self.env = env
        self.index = index
        self.role = role  # "both", or "prefill" / "decode" under disaggregation
        self.sim = sim
        self.setup = setup  # its GPUs, pool and step times, as its role's replicas share them
        self.allocator = allocator
        self.pool_scale = 1.0  # its slots in those of the pool the summary is of (see run)
        overflow_to_max = getattr(sim.system.allocator, "on_overflow", None) == "request_max"

        # vLLM's balancer counts who waits: it hears of every intake, seating and
        # preemption here.
        self.tells_balancer = (sim.router is not None and sim.router.counts_waiting
                             and role != "decode")

        def scheduler(waiting: WaitingLine | None = None) -> Scheduler:
            return Scheduler(allocator, sim.system.scheduler, sim.debug, setup.swap_slots,
                             sim.predicted_output, overflow_to_max=overflow_to_max,
                             sliding_window=sim.sliding_window, speculative=setup.speculative,
                             waiting=waiting, queue_timeout_s=sim.queue_timeout_s,
                             ttft_timeout_s=sim.ttft_timeout_s,
                             e2e_timeout_s=sim.e2e_timeout_s,
                             itl_timeout_s=sim.itl_timeout_s,
                             tells_seatings=self.tells_balancer,
                             line_seed=f"{sim.seed} {index}")

        self.scheduler = scheduler()
        # Pipeline stages: a scheduler for each batch in flight, all of one allocator, one
        # waiting line and one max_num_seqs (vLLM's one scheduler never schedules a request
        # again before the batch it is in comes back).
        self.schedulers = [self.scheduler, *(scheduler(self.scheduler.waiting)
                                             for _ in setup.stage_shares[1:])]
        if len(self.schedulers) > 1:
            for sched in self.schedulers:
                sched.share_seats(self.schedulers)
        # Stage-seconds the stages computed, and seconds some batch was in flight.
        self.stage_busy_s = 0.0
        self.in_flight_s = 0.0
        self.rho = setup.rho
        self.open: list[int] = []  # open-arrival request indices, in arrival order
        self.open_pos = 0
        # (release time, request index, the Request if already made) heap: session turns,
        # and requests handed over from a prefill replica.
        self.released: list[tuple[float, int, Request | None]] = []
        self.clock = 0.0
        self.wake: simpy.Event = env.event()
        self.idle = False
        # A prefill replica holds a handed-over request's KV until it is sent: (when it is
        # sent, request index, request) heap, released at the first step boundary after.
        self.held: list[tuple[float, int, Request]] = []
        self.scheduler.keep_finished = role == "prefill"
        if role == "decode":  # (its prompts were read elsewhere: nothing to read first)
            self.scheduler.prefill_first = False
        # A line that turns new arrivals away when full (scheduler.max_queued_requests).
        self.bounded = (role != "decode"
                        and sim.system.scheduler.max_queued_requests is not None)

    # -------------------------------------------------------------- arrivals
    def next_arrival(self) -> float:
        """When a request may next join this replica (a routed one may be routed here)."""
        t = self.sim.next_unrouted_s()
        if self.open_pos < len(self.open):
            t = min(t, self.sim.arrival_s[self.open[self.open_pos]])
        if self.released:
            t = min(t, self.released[0][0])
        return t

    def pull_arrivals(self) -> None:
        """Queue every request that has arrived by the replica's clock, in time order; then
        let go those whose clients gave up by then, waiting or seated (recorded at the time
        they did)."""
        sim = self.sim
        sim.route_until(self.clock)
        while True:
            t_open = (sim.arrival_s[self.open[self.open_pos]] if self.open_pos < len(self.open)
                      else math.inf)
            t_rel = self.released[0][0] if self.released else math.inf
            t = min(t_open, t_rel)
            if t > self.clock:
                break
            prepared = None
            if t_open <= t_rel:
                index = self.open[self.open_pos]
                self.open_pos += 1
            else:
                _, index, prepared = heapq.heappop(self.released)
            request = prepared or sim.first_try(index, t)
            if self.role == "prefill":
                sim.serve_as(request, self)
            if self.tells_balancer and not request.rejected:
                sim.router.taken_in(sim.router_key(request), self.index,  # type: ignore[union-attr]
                                    self.clock)
            # (A decode replica's line takes every request handed over: none is shed.)
            bounded = self.bounded and self.joins_on_its_own(request)
            if request.rejected or request.shed or not self.scheduler.add(request, bounded):
                sim.on_done(self, request, t)
        if sim.clients_give_up:
            for request in self.scheduler.time_out(self.clock):
                sim.on_done(self, request, request.abandoned_s)

    def joins_on_its_own(self, request: Request) -> bool:
        """Whether ``request``, arriving, finds a bounded line as it is: a sample of a
        request kept together follows the first of its try instead, which arrived just
        before it, into the line (past its bound) or turned away with it (marked shed)."""
        first = self.sim.first_sample
        if request.siblings is None or first is None or request.index == first[request.index]:
            return True
        request.shed = request.siblings.shed
        return False

    # -------------------------------------------------------------- the loop
    def arrivals(self):  # type: ignore[no-untyped-def]
        """SimPy process: wake the engine when an open arrival reaches an idle replica."""
        for index in self.open:
            t = self.sim.arrival_s[index]
            if t > self.env.now:
                yield self.env.timeout(t - self.env.now)
            self.wake_if_idle()

    def wake_if_idle(self) -> None:
        """Wake the replica if it idles (it looks at its line anew)."""
        if self.idle and not self.wake.triggered:
            self.wake.succeed()

    def run(self):  # type: ignore[no-untyped-def]
        """SimPy process: schedule → step → advance, until no work is left."""
        if len(self.schedulers) > 1:
            yield from self.run_pipeline()
            return
        sim = self.sim
        sched = self.scheduler
        while True:
            sched.notice_time(self.clock)
            self.pull_arrivals()
            if not sched.running and not sched.waiting:
                t = self.next_arrival()
                if t == math.inf and not sim.waits_forever:
                    return
                self.clock = max(self.clock, (yield from self.idle_until(t)))
                continue
            self.release_sent(self.clock)
            start = self.clock
            if sim.jump and sched.fast_step_ready() and sched.fast_step():
                # Pure decode with nothing to decide: run steps until an event needs one.
                batch = Batch()
                sched.fill_decode(batch)
                snap = sched.snapshot()
                # An arrival matters only to an empty queue (behind a blocked head it
                # waits), unless its priority, its length or its cached prompt may put it
                # ahead of that head, a bounded line may turn it away, or vLLM's balancer
                # hears of its intake.
                heeded = (not sched.waiting or sched.waiting.may_be_passed() or self.bounded
                          or self.tells_balancer)
                stop_at = self.next_arrival() if heeded else math.inf
                if self.role == "decode" and heeded:
                    stop_at = min(stop_at, sim.handover_horizon())
                stop_at = min(stop_at, sched.next_promotion_s())
                if sim.patience_s is not None:
                    # One arriving meanwhile may give up meanwhile too: the router learns of
                    # that when stepping would tell it.
                    stop_at = min(stop_at, self.next_arrival() + sim.patience_s)
                if sim.reroutes:
                    stop_at = min(stop_at, sim.retry_horizon(self))
                timing = self.setup.timings[batch.draft_tokens]
                quiet = sched.decode_quietly(
                    timing.decode_step_time(batch.decode_seqs, self.rho), start, stop_at, snap)
                steps, clock, finished = quiet.steps, quiet.clock_s, quiet.finished
            else:
                batch = sched.schedule(start)
                if batch.empty and self.held:
                    # What waits needs memory still being sent on: wait until it is.
                    self.clock = self.held[0][0]
                    if self.clock > self.env.now:
                        yield self.env.timeout(self.clock - self.env.now)
                    continue
                if batch.empty:
                    raise self.stuck()
                snap = sched.snapshot()
                quiet = None
                clock = start + self.step_duration(batch)
                steps = 1
                finished = self.finish_step(batch, clock)
            self.end_steps(start, clock, steps, batch, snap, quiet, finished)
            if clock > self.env.now:
                yield self.env.timeout(clock - self.env.now)

    def idle_until(self, t: float):  # type: ignore[no-untyped-def]
        """Wait until ``t`` (if later than now), or until another replica hands this one a
        request; the time it is then."""
        if t <= self.env.now:
            return t
        self.idle = True
        self.wake = self.env.event()
        yield self.wake if t == math.inf else self.wake | self.env.timeout(t - self.env.now)
        self.idle = False
        return self.env.now

    def run_pipeline(self):  # type: ignore[no-untyped-def]
        """SimPy process of an engine in pipeline stages: every batch slot not in flight
        schedules a batch of its own requests, which passes the stages in turn, each taking
        the next batch when done with the last; the slot schedules again when its batch
        comes out of the last stage. Until no work is left (stepping in either mode)."""
        env = self.env
        schedulers = self.schedulers
        stage_free = [0.0] * len(schedulers)  # when each stage is done with its last batch
        ready = list(range(len(schedulers)))  # slots not in flight, as they came back
        in_flight = []  # (when done, launch order, slot, batch, launched at, memory then)
        launches = 0
        covered_s = 0.0  # in-flight time is counted up to here
        while True:
            now = self.clock
            for sched in schedulers:
                sched.notice_time(now)
            self.pull_arrivals()
            for slot in list(ready):
                sched = schedulers[slot]
                if not sched.running and not sched.waiting:
                    continue
                batch = sched.schedule(now)
                if batch.empty:
                    continue  # its line's head waits for memory the batches in flight hold
                ready.remove(slot)
                done = self.pipeline_pass(batch, now, stage_free)
                self.in_flight_s += done - max(now, covered_s)
                covered_s = done
                heapq.heappush(in_flight, (done, launches, slot, batch, now, self.snapshot()))
                launches += 1
            if not in_flight:
                if self.scheduler.waiting or any(s.running for s in schedulers):
                    raise self.stuck()
                t = self.next_arrival()
                if t == math.inf and not self.sim.waits_forever:
                    return
                self.clock = max(self.clock, (yield from self.idle_until(t)))
                continue
            # The next batch out, or an arrival a free slot may take before that.
            t = in_flight[0][0]
            arrival = self.next_arrival() if ready else math.inf
            if self.clock < arrival < t:
                self.clock = arrival
            else:
                _, _, slot, batch, start, snap = heapq.heappop(in_flight)
                sched = schedulers[slot]
                self.end_steps(start, t, 1, batch, snap, None,
                               self.finish_step(batch, t, sched))
                ready.append(slot)
            if self.clock > env.now:
                yield env.timeout(self.clock - env.now)

    def pipeline_pass(self, batch: Batch, start_s: float, stage_free: list[float]) -> float:
        """When ``batch``, scheduled at ``start_s``, comes out of the pipeline: each stage
        computes its layers' share of the step once it has the batch and is done with the
        one before (``stage_free``, moved on), the activations cross to the next stage, and
        the step's fixed CPU cost (scheduling, sampling) comes once, at the end."""
        setup = self.setup
        compute_s = self.step_duration(batch) - setup.pass_overhead_s
        hop_s = setup.hop_latency_s + (batch.decode_seqs + batch.prefill_tokens) * (
            setup.hop_s_per_token)
        t = start_s
        for stage, share in enumerate(setup.stage_shares):
            if stage:
                t += hop_s
            t = max(t, stage_free[stage]) + share * compute_s
            stage_free[stage] = t
        self.stage_busy_s += compute_s
        return t + setup.pass_overhead_s

    def snapshot(self) -> MemorySnapshot:
        """Memory now: the allocator's, with every batch slot's lazily written tokens."""
        snap = self.scheduler.snapshot()
        pending = sum(sched.pending_slots() for sched in self.schedulers[1:])
        if not pending:
            return snap
        return snap._replace(token=snap.token + pending, reserved=snap.reserved - pending)

    def release_sent(self, now_s: float) -> None:
        """Free the KV this prefill replica held for requests sent on by ``now_s``."""
        while self.held and self.held[0][0] <= now_s:
            self.scheduler.release(heapq.heappop(self.held)[2])

    def stuck(self) -> SimulationError:
        """The error of a step with work to do and nothing it can run."""
        sched = self.scheduler
        return SimulationError(f"replica {self.index}: nothing can run although "
                               f"{len(sched.running)} requests run and {len(sched.waiting)} "
                               "wait")

    def step_duration(self, batch: Batch, round_tokens: int = 0) -> float:
        """Seconds ``batch`` takes as one step (``round_tokens``: all data-parallel ranks'
        tokens in a step they take together; see :meth:`StepTimeModel.step_time`)."""
        setup = self.setup
        timing = setup.timings[batch.draft_tokens]
        duration = timing.step_time(batch.decode_seqs, batch.context_tokens,
                                    batch.prefill_tokens, batch.prefill_pairs, self.rho,
                                    batch.skipped_context, batch.skipped_pairs, round_tokens)
        if batch.loaded_tokens:  # host-cache hits, read up for the step
            duration = with_transfer(duration, batch.loaded_tokens * setup.host_s_per_token,
                                     self.sim.pipelined_layers)
        if batch.swapped_slots:  # copied before the step computes, as vLLM v0 does
            # A copy at a time: as long as the bytes take over the link, or, for many small
            # blocks, as long as issuing their copies takes.
            duration += max(batch.swapped_slots * setup.host_s_per_token,
                            batch.swapped_units * setup.swap_unit_s)
        return duration

    def finish_step(self, batch: Batch, clock_s: float,
                    sched: Scheduler | None = None) -> list[Request]:
        """End the step of ``batch`` (of ``sched``, a pipeline's batch slot, else the
        replica's scheduler) at ``clock_s``: the requests it finished (the router told of
        the requests it seated or preempted and the prompts it read)."""
        finished = (sched or self.scheduler).finish_step(batch, clock_s)
        if self.sim.router is not None and self.role != "decode":
            self.sim.tell_router(self, batch, clock_s)
            self.scheduler.log_usage(clock_s)
        return finished

    def end_steps(self, start_s: float, clock_s: float, steps: int, batch: Batch,
                  snap: MemorySnapshot, quiet: QuietDecode | None,
                  finished: list[Request]) -> None:
        """Record the step (or ``quiet`` run of steps) from ``start_s`` to ``clock_s``
        that began holding ``snap``, and be done with the requests it ``finished``."""
        sim = self.sim
        sim.recorder.record(self.index, start_s, clock_s - start_s, steps, batch,
                            self.scheduler, snap, quiet,
                            len(finished) + (quiet.aborted if quiet else 0), self.pool_scale,
                            self.schedulers if len(self.schedulers) > 1 else None)
        self.clock = clock_s
        for request in finished:
            self._account_finish(request)
            sim.on_done(self, request, clock_s, start_s)

    def _account_finish(self, request: Request) -> None:
        # Allocation at finish time, for the "waste at completion" figure (seed: 63.4 %).
        if isinstance(self.allocator, ContiguousAllocator):
            per_sample = self.allocator.reservation(request.spec())
        else:
            bs = self.allocator.block_size  # type: ignore[attr-defined]
            per_sample = -(-request.final_len // bs) * bs
        self.sim.allocated_at_finish[request.index] = per_sample * request.n


def cuda_graph_tokens(system: SystemConfig) -> int:
    """The most tokens a step of ``system`` runs in a CUDA graph, as vLLM sizes its largest
    by default (``max_cudagraph_capture_size``): twice a full batch of decodes and their
    drafts, at most 512 and the step's token budget. A larger step runs without one."""
    scheduler = system.scheduler
    drafts = system.speculative.num_speculative_tokens if system.speculative else 0
    return min(scheduler.max_num_seqs * (1 + drafts) * 2, 512,
               scheduler.max_num_batched_tokens)


class _RankGroup:
    """The data-parallel ranks of one engine of a mixture of experts. Every MoE layer sends
    each rank's tokens to their experts, on all the ranks' GPUs, and back, so the ranks step
    together, as carriages coupled into one train leave each station together: a round lasts
    as long as its slowest rank's step, and a rank with nothing to do waits it out (vLLM runs
    it a dummy batch) while any other works. A new request joins its rank at the next round.
    Rounds go step by step in either engine mode."""

    def __init__(self, env: simpy.Environment, ranks: list[_Replica],
                 cuda_graph_tokens: int) -> None:
        self.env = env
        self.ranks = ranks
        self.cuda_graph_tokens = cuda_graph_tokens  # the most tokens a rank's graphs run
        self.clock = 0.0
        # Rank-seconds of the rounds' busy ranks, and of that spent waiting on a slower one.
        self.busy_s = 0.0
        self.waited_s = 0.0

    def run(self):  # type: ignore[no-untyped-def]
        """SimPy process: every rank schedules → the round steps → advance, until no rank
        has work left (or, when replicas hand requests over, forever: SimPy stops when no
        event is left)."""
        env = self.env
        waits_forever = self.ranks[0].sim.waits_forever
        while True:
            busy = []
            for rank in self.ranks:
                rank.clock = self.clock
                rank.scheduler.notice_time(self.clock)
                rank.pull_arrivals()
                if rank.scheduler.running or rank.scheduler.waiting:
                    busy.append(rank)
            if not busy:
                t = self.next_arrival()
                if t == math.inf and not waits_forever:
                    return
                self.clock = max(self.clock, (yield from self.idle_until(t)))
                continue
            start = self.clock
            planned = []
            for rank in busy:
                sched = rank.scheduler
                rank.release_sent(start)
                batch = sched.schedule(start)
                if batch.empty and rank.held:
                    continue  # what waits needs memory still being sent on: it sits out
                if batch.empty:
                    raise rank.stuck()
                planned.append((rank, batch, sched.snapshot()))
            if not planned:
                # Every busy rank waits for its memory to be sent on: until the first is, or
                # until a request arrives that another rank may run.
                t = min(self.next_arrival(), *(rank.held[0][0] for rank in busy))
                self.clock = max(self.clock, (yield from self.idle_until(t)))
                continue
            tokens = [batch.decode_seqs * (1 + batch.draft_tokens) + batch.prefill_tokens
                      for _, batch, _ in planned]
            # A round every rank's CUDA graphs can run pads each to the most tokens of any,
            # idle ones too (vLLM's DP padding), and the padding goes to experts as well.
            most = max(tokens)
            round_tokens = (len(self.ranks) * most if most <= self.cuda_graph_tokens
                            else sum(tokens))
            own_s = [rank.step_duration(batch, round_tokens) for rank, batch, _ in planned]
            round_s = max(own_s)
            clock = start + round_s
            for (rank, batch, snap), step_s in zip(planned, own_s, strict=True):
                rank.end_steps(start, clock, 1, batch, snap, None,
                               rank.finish_step(batch, clock))
                self.busy_s += round_s
                self.waited_s += round_s - step_s
            self.clock = clock
            if clock > env.now:
                yield env.timeout(clock - env.now)

    def next_arrival(self) -> float:
        """When a request may next join any of the ranks."""
        return min(rank.next_arrival() for rank in self.ranks)

    def idle_until(self, t: float):  # type: ignore[no-untyped-def]
        """Wait until ``t`` (if later than now), or until another replica hands a rank a
        request (the ranks share one wake event); the time it is then."""
        env = self.env
        if t > env.now:
            wake = env.event()
            for rank in self.ranks:
                rank.idle, rank.wake = True, wake
            yield wake if t == math.inf else wake | env.timeout(t - env.now)
            for rank in self.ranks:
                rank.idle = False
            return env.now
        return t


@dataclass
class _RoleSetup:
    """What the replicas of one role share (all of them, or under disaggregation the prefill
    or the decode replicas, whose GPUs may be spread otherwise): their GPUs, pool and step
    times, from the scenario as they see it."""

    scenario: Scenario  # with the role's parallelism
    pool_slots: int
    unit_slots: int  # a block, a page, or 1 (see allocation_unit)
    host_slots: int
    swap_slots: int
    host_s_per_token: float
    # Seconds to issue the copies of one swapped block (page, extent): vLLM v0 copies each
    # layer's K and V of it apart, one cudaMemcpyAsync each.
    swap_unit_s: float
    timing: StepTimeModel  # with its speculation
    rho: float
    # The model of a step that verifies K drafts, for every K a step may (one, unless K goes
    # by batch size), and the K by batch size an auto schedule chose (None for any other).
    timings: dict[int, StepTimeModel]
    speculative: SpeculativeConfig | None
    auto_schedule: list[tuple[int, int, int]] | None
    # Pipeline stages: each one's share of the layers (one stage: (1.0,)), the seconds a
    # batch's activations take to the next (fixed, and per token), and the CPU part of a
    # step's fixed cost, which a batch pays once.
    stage_shares: tuple[float, ...] = (1.0,)
    hop_latency_s: float = 0.0
    hop_s_per_token: float = 0.0
    pass_overhead_s: float = 0.0

    @classmethod
    def build(cls, scenario: Scenario, system: SystemConfig, trace: Trace,
              timing: StepTimeModel, pool_slots: int, base_dir: Path) -> _RoleSetup:
        """The setup of replicas that see ``scenario``, timed by ``timing`` (before
        speculation) with pools of ``pool_slots``."""
        timing = with_speculation(timing, scenario, system, base_dir)
        unit_slots = allocation_unit(scenario, system)
        # Only a block table costs attention its indirection: contiguous extents and
        # contiguous virtual memory are read directly.
        rho = timing.rho(unit_slots if isinstance(system.allocator, PagedConfig) else None)
        # An auto schedule is chosen by the mean context a decode step reads for a
        # sequence: each request's mean (its prompt and half its output) weighted by its
        # decode steps, as the long ones fill more of the batch.
        spec = system.speculative
        timings = {drafts: replace(timing, speculative_tokens=drafts)
                   for drafts in (spec.draft_counts if spec else [0])}
        auto_schedule = None
        if spec is not None and spec.num_speculative_tokens_per_batch_size == "auto":
            context = float(np.average(trace.prompt_len + trace.output_len / 2,
                                       weights=trace.output_len))
            widest = int(trace.n.max()) if len(trace) else 1  # sequences a request decodes
            auto_schedule = best_draft_schedule(
                timings, spec, context, rho, system.scheduler.max_num_seqs * widest)
            spec = spec.with_schedule(auto_schedule)
        host_slots, swap_slots, host_s_per_token = host_memory(scenario, system)
        model = scenario.model_spec()
        swap_unit_s = (system.scheduler.swap_copy_overhead_s * model.kv_layers
                       * model.kv_tensors_per_layer if swap_slots else 0.0)
        setup = cls(scenario, pool_slots, unit_slots, host_slots, swap_slots, host_s_per_token,
                    swap_unit_s, timing, rho, timings, spec, auto_schedule)
        parallel = scenario.parallel
        stages = parallel.pipeline_parallel_size
        if stages == 1:
            return setup
        return replace(
            setup, stage_shares=tuple(layers / model.num_layers
                                      for layers in model.pipeline_stage_layers(stages)),
            hop_latency_s=parallel.allreduce_latency_s,
            hop_s_per_token=pipeline_hop_s_per_token(
                model, scenario.gpu_spec(), parallel.tensor_parallel_size, stages,
                parallel.pipeline_link_gbps),
            pass_overhead_s=scenario.timing.step_overhead_s)

    @property
    def gpus(self) -> int:
        """The GPUs of one of its replicas' ranks (its tensor-parallel group)."""
        return self.scenario.parallel.tensor_parallel_size

    @property
    def ranks(self) -> int:
        """The data-parallel ranks of one of its replicas, which step together."""
        return self.scenario.parallel.data_parallel_size


@dataclass
class _SampleGroup:
    """The samples of one request run as requests of their own (``fan_out``) done so far:
    the request is served only if all of them are, so what the others were given waits
    here until the last is done."""

    output_tokens: int = 0  # generated for the samples finished
    token_runs: list[tuple[list[int], int, int]] = field(default_factory=list)  # theirs
    given_up: bool = False  # the client gave up on one (on all that were not done)


@dataclass
class _SampleTry:
    """One try of a request fanned out whose client gives up on an answer and sends it
    again (``e2e_timeout_s`` or ``itl_timeout_s``, with ``retry``): the samples done in
    time wait here until every sample of the try is done, to be recorded if the client
    had them all, or sent again with the others if it gave up."""

    pending: int  # samples of the try not done yet
    given_up_s: float = -1.0  # when the client gave up on it (-1: not yet)
    resent: bool = False  # whether the client sent it again then
    # The samples done in time, each with the replica that served it and when.
    held: list[tuple[_Replica, Request, float]] = field(default_factory=list)


class _SystemRun:
    """Everything one system's simulation shares between its replicas."""

    def __init__(self, scenario: Scenario, system: SystemConfig, trace: Trace,
                 decode: _RoleSetup, prefill: _RoleSetup,
                 progress: Callable[[int], None] | None,
                 request_of: np.ndarray | None = None) -> None:
        self.system = system
        self.trace = trace
        # Under parallel_sampling fan_out, the request each of the trace's samples is of,
        # how many samples each request has, and how many of them are not done yet (None:
        # one row each).
        self.request_of = request_of
        self.samples_of = np.bincount(request_of).tolist() if request_of is not None else []
        self.samples_left = list(self.samples_of) if request_of is not None else None
        self.sample_groups: dict[int, _SampleGroup] = {}  # by request, while it has samples
        # What the client of each request fanned out waits for of its samples, where it
        # waits for a seat or a first token or a full line turns requests away: by request
        # and try, until each of its samples has started that try, with how many have yet
        # to (else None).
        workload = scenario.workload
        self.siblings: dict[tuple[int, int], tuple[Siblings, int]] | None = (
            {} if request_of is not None and (
                (workload.queue_timeout_s, workload.ttft_timeout_s,
                 workload.itl_timeout_s) != (None, None, None)
                or system.scheduler.max_queued_requests is not None)
            else None)
        # Where a client waits for a next token of any sample, each try's samples know one
        # another until they are done (Siblings.members).
        self.siblings_known = request_of is not None and workload.itl_timeout_s is not None
        # The replicas' setups: the scenario's (colocated, or decode replicas), and the
        # prefill replicas' under disaggregation (the same one unless spread otherwise).
        self.decode_setup, self.prefill_setup = decode, prefill
        model = scenario.model_spec()
        self.sliding_window = model.sliding_window  # 0: none
        self.jump = scenario.engine.mode == "jump"
        self.debug = scenario.engine.debug_invariants
        if self.debug and not __debug__:
            raise ScenarioError("engine.debug_invariants: its checks are assert statements, "
                                "which python -O removes; run without -O, or set it false")
        self.duration_s = scenario.stop.duration_s
        self.gpus = scenario.gpus
        # Data-parallel ranks: each engine's D ranks step together (see run).
        self.rank_groups: list[_RankGroup] = []
        self.usd_per_gpu_hour = scenario.cost.usd_per_gpu_hour if scenario.cost else None
        self.slo = scenario.slo
        # Clients' patience: for a seat, for a first token, for the whole answer, for a next
        # token (None: for ever); the soonest a new arrival may give up (before it has a
        # token to wait past); and what clients do when their patience runs out.
        workload = scenario.workload
        self.queue_timeout_s = workload.queue_timeout_s
        self.ttft_timeout_s = workload.ttft_timeout_s
        self.e2e_timeout_s = workload.e2e_timeout_s
        self.itl_timeout_s = workload.itl_timeout_s
        self.clients_give_up = clients_time_out(workload)
        # Clients who may give up on a request seated or answering, and so waste its work.
        self.seated_time_out = (self.ttft_timeout_s, self.e2e_timeout_s,
                                self.itl_timeout_s) != (None, None, None)
        self.mid_answer_time_out = (self.e2e_timeout_s, self.itl_timeout_s) != (None, None)
        timeouts = [t for t in (self.queue_timeout_s, self.ttft_timeout_s, self.e2e_timeout_s)
                    if t is not None]
        self.patience_s = min(timeouts) if timeouts else None
        # Output tokens generated for tries whose clients gave up (every try's).
        self.abandoned_output_tokens = 0
        # Output tokens of every sample that fork groups had generated when they started
        # over (None in the summary where no request runs forks).
        self.discarded_output_tokens = 0
        self.forks = (system.scheduler.parallel_sampling == "fork" and len(trace) > 0
                      and int(trace.n.max()) > 1)
        # The waits of the tokens those tries' clients received (µs → tokens): taken out of
        # the ITL, which vLLM's benchmark counts over the requests served alone.
        self.vain_token_waits_us: Counter[int] = Counter()
        self.retry = scenario.workload.retry
        # Under fan_out, a client who gives up on an answer (whole, or a next token) and
        # tries again sends every sample again, those done in time too: each try of such a
        # request, by request and try, while some of its samples are not done (else None).
        self.sample_tries: dict[tuple[int, int], _SampleTry] | None = (
            {} if request_of is not None and self.retry is not None and (
                scenario.workload.e2e_timeout_s, scenario.workload.itl_timeout_s) != (
                    None, None) else None)
        self.seed = scenario.seed
        # Prefill/decode disaggregation: replicas [0, P) prefill, [P, replicas) decode
        # (counted in ranks: P is the prefill engines' ranks).
        split = scenario.engine.disaggregation
        self.prefill_replicas = scenario.prefill_ranks
        self.handovers = split is not None  # replicas receive requests from one another
        self.decode_replicas = scenario.ranks - self.prefill_replicas if split else 0
        self.least_loaded_decode = split is not None and split.decode_router == "least_loaded"
        # Decode replicas send prefill replicas retries of answers their clients gave up on.
        self.retries_from_decode = split is not None and self.retry is not None and (
            self.mid_answer_time_out)
        # For the least-loaded choice: requests handed to each decode replica and not yet
        # done, and a heap of (when done, decode replica) for those yet to be counted out.
        self.decode_in_flight = [0] * self.decode_replicas
        self.decode_done: list[tuple[float, int]] = []
        # The decode replica each request's samples go to, where they go together (chosen
        # at the first one's handover).
        self.decode_of_request: dict[int, int] = {}
        if split is not None:
            # Each GPU sends its share of the KV heads over its own link, side by side, and
            # receives its share likewise: the side with fewer GPUs a rank sets the pace.
            per_gpu = max(model.kv_bytes_per_token_per_gpu(setup.gpus)
                          for setup in (prefill, decode))
            self.transfer_s_per_token = per_gpu / (split.kv_transfer_gbps * 1e9)
            self.transfer_latency_s = split.kv_transfer_latency_s
            self.transfer_layers = (model.num_layers
                                    if split.kv_transfer == "layerwise" else 0)
            # Under the hybrid manager a sliding layer sends only what the decode side's
            # first token sees.
            self.sliding_transfer_share = (model.num_sliding_layers / model.num_layers
                                           if uses_hybrid_kv_cache(model, system) else 0.0)
        self.predicted_output = (
            predicted_output_lengths(trace, system.length_predictor, scenario.seed)
            if system.uses_predictor else None)
        self.pipelined_layers = (model.num_layers if getattr(
            system.allocator, "host_load", "serial") == "layerwise" else 0)
        self.arrival_s = trace.arrival_s.tolist()
        self.output_lens = trace.column_lists()["output_len"]  # a prefill replica's is 1
        self.think_s = trace.think_s.tolist()
        # One row per finished or rejected request, written when it is done, so that the
        # Request object (its content, its spec) is freed then, not kept to the end.
        self.request_rows = _RowBuffer(
            [*REQUEST_COLUMNS, *(HANDOVER_COLUMNS if self.handovers else ())],
            {"rejected": bool, "shed": bool})
        self.allocated_at_finish = np.zeros(len(trace), dtype=np.int64)
        self.recorder = _Recorder(scenario.engine.sample_interval_s)
        self.progress = progress
        self.done = 0
        # Dependents: request → the requests released when it is done.
        after = trace.after
        order = np.argsort(after, kind="stable")
        self.dependents: dict[int, list[int]] = {}
        for index in order[after[order] >= 0].tolist():
            self.dependents.setdefault(int(after[index]), []).append(index)
        # Routing: open arrivals round-robin up front, or by the router as they come;
        # dependents follow the request they wait on.
        replicas = scenario.ranks  # (engines, or their data-parallel ranks)
        routed = self.prefill_replicas or replicas  # the replicas new requests go to
        self.routed_replicas = routed
        # A client's retry goes through the balancer again: to the next replica in turn, or
        # where the router sends it (with one replica to send to, back to it).
        self.reroutes = self.retry is not None and routed > 1
        # Whether an idle replica may still be sent work by another one (a handover, a
        # retry): it then waits for ever rather than end (SimPy stops when nothing is left).
        self.waits_forever = self.handovers or self.reroutes
        # Retries the router has yet to place: (when it places them, request index, the
        # request), placed in that order among the open arrivals (a request has one try on
        # its way at a time, so the index settles ties).
        self.retry_stream: list[tuple[float, int, Request]] = []
        routing = scenario.engine.router
        policy = routing.policy
        self.replica_of = np.zeros(len(trace), dtype=np.int64)
        roots = np.flatnonzero(after < 0)
        self.router: Router | None = None
        self.unrouted: list[int] = []  # open arrivals the router has yet to place, in order
        self.unrouted_pos = 0
        # A balancer in front of the engines sends each a request whole, its samples run as
        # requests of their own (fan_out) with it; vLLM's balancer of its data-parallel
        # ranks places each sample, as its front end fans the request out first (where
        # there is more than one to place it on).
        self.first_sample: np.ndarray | None = None
        if request_of is not None and (policy not in ("vllm_dp", "vllm_dp_2026")
                                       or routed == 1):
            starts = np.concatenate(([0], np.cumsum(self.samples_of)[:-1]))
            self.first_sample = starts[request_of]
        # Such a balancer sees requests, not their samples: it counts a request once, from
        # when it sends it until its last sample is done there (by request and try, the
        # samples not done yet).
        self.router_sees_requests = (self.first_sample is not None and policy not in (
            "round_robin", "vllm_dp", "vllm_dp_2026"))
        self.samples_out: dict[tuple[int, int], int] = {}
        if policy == "round_robin":
            turns = (np.arange(len(roots)) if self.first_sample is None or request_of is None
                     else np.unique(request_of[roots], return_inverse=True)[1])
            self.replica_of[roots] = turns % routed
            for index in np.flatnonzero(after >= 0).tolist():
                self.replica_of[index] = self.replica_of[after[index]]
        else:
            # What a replica can cache: its GPU pool and its host tier.
            self.router = Router(policy, routed, prefill.pool_slots + prefill.host_slots,
                                 cache_threshold=routing.cache_threshold,
                                 balance_abs_threshold=routing.balance_abs_threshold,
                                 balance_rel_threshold=routing.balance_rel_threshold,
                                 overlap_score_weight=routing.overlap_weight,
                                 track_prefill_tokens=routing.tracks_prefill,
                                 temperature=routing.sampling_temperature,
                                 ttl_s=routing.prefix_ttl_s,
                                 stats_interval_s=routing.report_interval_s,
                                 front_ends=routing.front_ends, seed=scenario.seed)
            self.unrouted = roots.tolist()
        self.env = simpy.Environment()
        self.replicas = []
        kv_model = cached_model(scenario, system)
        for r in range(replicas):
            role = ("both" if not self.handovers
                    else "prefill" if r < self.prefill_replicas else "decode")
            setup = prefill if role == "prefill" else decode
            allocator = build_allocator(system, setup.pool_slots, model.max_model_len,
                                        setup.host_slots, setup.unit_slots, kv_model,
                                        setup.gpus)
            replica = _Replica(self.env, r, self, allocator, setup, role)
            if self.router is None:
                replica.open = roots[self.replica_of[roots] == r].tolist()
            self.replicas.append(replica)
        if self.router is not None and routing.kv_events:
            self.router.watch_caches(self.kv_events(self.replicas[:routed]))
        if self.router is not None and self.router.reads_usage:
            logs: list[deque[tuple[float, float]]] = [deque() for _ in range(routed)]
            for replica, log in zip(self.replicas, logs, strict=False):
                replica.scheduler.usage_log = log
            self.router.watch_usage(logs)

    @staticmethod
    def kv_events(replicas: list[_Replica]) -> CacheEvents:
        """The KV events of ``replicas``' GPU caches, as their engines publish them (none
        from a pool without a prefix cache: contiguous extents, or paging with caching off;
        the replicas of a system are alike)."""
        caching = [r.allocator for r in replicas if isinstance(r.allocator, PagedAllocator)
                   and r.allocator.enable_prefix_caching]
        if not caching:
            return CacheEvents([deque() for _ in replicas], None)
        return CacheEvents([allocator.pool.log_events() for allocator in caching],
                           caching[0].block_size)

    def next_unrouted_s(self) -> float:
        """When the router next places a request: an open arrival, or a retry (inf if it
        has none to place)."""
        t = self.retry_stream[0][0] if self.retry_stream else math.inf
        if self.unrouted_pos < len(self.unrouted):
            return min(t, self.arrival_s[self.unrouted[self.unrouted_pos]])
        return t

    def route_until(self, clock_s: float) -> None:
        """Place every open arrival and retry up to ``clock_s`` (whichever replica gets
        there first), in time order: the router sees the same past whichever it is, so
        routing is the same in both modes."""
        router = self.router
        while router is not None and self.next_unrouted_s() <= clock_s:
            stream = self.retry_stream
            first_s = (self.arrival_s[self.unrouted[self.unrouted_pos]]
                       if self.unrouted_pos < len(self.unrouted) else math.inf)
            if stream and stream[0][0] < first_s:  # (a first try first, at the same time)
                route_s, index, request = heapq.heappop(stream)
            else:
                index = self.unrouted[self.unrouted_pos]
                self.unrouted_pos += 1
                route_s = first_s
                request = Request(self.trace, index, route_s)
            first = index if self.first_sample is None else int(self.first_sample[index])
            if first != index:  # (its try routed just before it)
                target = self.replicas[int(self.replica_of[first])]
            else:
                target = self.replicas[router.route(route_s, request.prompt_segments,
                                                    request.prompt_len)]
            self.replica_of[index] = target.index
            self.serve_as(request, target)
            if request.attempts > 1:
                self.release(target, route_s, index, request)
            else:
                target.open.append(index)
            # Requests the pool will refuse never load a replica: the router knows at once.
            if self.accepts(target, request) and (first == index
                                                  or not self.router_sees_requests):
                router.assign(target.index, request.prompt_segments,
                              self.router_key(request))

    def first_try(self, index: int, arrival_s: float) -> Request:
        """Request ``index`` as it arrives at ``arrival_s``, the first time: a sample of a
        request fanned out shares what it waits for with its siblings (see
        :meth:`_share_waits`)."""
        request = Request(self.trace, index, arrival_s)
        self._share_waits(request)
        return request

    def _share_waits(self, request: Request) -> None:
        """Give a sample of a request fanned out, whose client waits for a seat, a first
        token or a next token, or may find the line full, what it waits for in common with
        its siblings of the same try (see :class:`~sim.scheduler.Siblings`)."""
        if self.siblings is None or self.request_of is None:
            return
        # (The try of one sample may start before another's try before it: each is its own.)
        this_try = (int(self.request_of[request.index]), request.attempts)
        siblings, waiting = self.siblings.get(this_try) or (Siblings(),
                                                            self.samples_of[this_try[0]])
        request.siblings = siblings
        if self.siblings_known:
            siblings.members.append(request)
        if waiting > 1:
            self.siblings[this_try] = (siblings, waiting - 1)
        else:  # every sample of the try has it
            self.siblings.pop(this_try, None)

    def new_request(self, index: int, arrival_s: float, replica: _Replica) -> Request:
        """Request ``index`` as ``replica`` serves it (see :meth:`serve_as`)."""
        return self.serve_as(Request(self.trace, index, arrival_s), replica)

    def serve_as(self, request: Request, replica: _Replica) -> Request:
        """``request`` as ``replica`` serves it: a prefill replica reads the prompt and
        gives the first token, so for it the request ends there. One that no decode replica
        could ever hold (every decode pool is alike) is marked rejected first: the prefill
        replica turns it away on arrival, as a colocated replica does, rather than read its
        prompt (as it does one whose prompt its own pool cannot hold)."""
        if replica.role == "prefill":
            decode = self.replicas[self.prefill_replicas]
            request.rejected = not decode.scheduler.fits_ever(request)
            request.output_len = 1
            request.max_len = request.prompt_len + 1
            request.spec_cache = None  # fits_ever described the whole request
        return request

    @staticmethod
    def accepts(replica: _Replica, request: Request) -> bool:
        """Whether ``replica`` will take ``request`` (as :meth:`serve_as` made it) rather
        than reject it on arrival."""
        return not request.rejected and replica.scheduler.fits_ever(request)

    def release(self, replica: _Replica, release_s: float, index: int,
                request: Request | None = None) -> None:
        """Queue ``index`` to join ``replica`` at ``release_s`` (waking it if idle)."""
        heapq.heappush(replica.released, (release_s, index, request))
        replica.wake_if_idle()

    def handover_horizon(self) -> float:
        """The earliest a prefill replica can still hand a request over: its next step
        starts no earlier than its clock (or, idle, its next arrival; with session turns or
        retries of answers given up, which decode replicas release, now), lasts at least the
        step's fixed cost, and the transfer its fixed latency. A decode replica's jump stops
        there, so it sees every handover when stepping would."""
        earliest = math.inf
        for replica in self.replicas[:self.prefill_replicas]:
            sched = replica.scheduler
            if sched.running or sched.waiting:
                start = replica.clock
            elif self.dependents or self.retries_from_decode:
                start = self.env.now
            else:
                start = max(replica.clock, replica.next_arrival())
            earliest = min(earliest, start)
        return earliest + self.prefill_setup.timing.min_fixed_s + self.transfer_latency_s

    def retry_horizon(self, receiver: _Replica) -> float:
        """The earliest a retry can reach ``receiver`` that it does not know of yet: another
        replica sees a client fail no earlier than it next looks (at the end of its step, or,
        idle, at its next arrival), and the retry joins no earlier than that. A jump stops
        there, so it sees every retry when stepping would."""
        earliest = math.inf
        for other in self.replicas[:self.routed_replicas]:
            if other is not receiver:
                earliest = min(earliest, other.next_arrival() if other.idle else other.clock)
        return earliest

    def _least_loaded_decode(self) -> int:
        """The decode replica (counted from the first) with the fewest requests in flight
        now, the first of equals. A replica that ran ahead already knows of later finishes;
        they count only from their time, so jump and step modes choose alike."""
        done, in_flight = self.decode_done, self.decode_in_flight
        while done and done[0][0] <= self.env.now:
            in_flight[heapq.heappop(done)[1]] -= 1
        return in_flight.index(min(in_flight))

    def _transfer_tokens(self, decode: _Replica, prompt_len: int) -> float:
        """Tokens of every layer's KV a prompt's transfer to ``decode`` sends: all of them,
        less, under the hybrid manager, the sliding layers' share of the blocks the first
        token computed there cannot see (the decode side never holds them)."""
        allocator = decode.scheduler.allocator
        if not (self.sliding_transfer_share and isinstance(allocator, HybridPagedAllocator)):
            return float(prompt_len)
        unseen = allocator.release_point(prompt_len)
        return prompt_len - self.sliding_transfer_share * unseen * allocator.block_size

    def _hand_over(self, prefill: _Replica, request: Request, now_s: float,
                   step_start_s: float) -> None:
        """A prefill replica gave ``request`` its first token in the step from
        ``step_start_s`` to ``now_s``: send its KV to a decode replica (by default the same
        one for a given request, whichever prefill replica served it; with ``decode_router:
        least_loaded``, the least loaded now; the samples of a request the router keeps
        together go where the first went), after that step or, layer by layer, under
        it. The prefill replica holds the KV until it is sent."""
        index = request.index
        # The samples of a request kept together go where the first one went.
        together = self.request_of if self.first_sample is not None else None
        key = index if together is None else int(together[index])
        position = self.decode_of_request.get(key, -1)
        if position < 0:
            position = (self._least_loaded_decode() if self.least_loaded_decode
                        else key % self.decode_replicas)
            if together is not None:
                self.decode_of_request[key] = position
        decode = self.replicas[self.prefill_replicas + position]
        rest = Request(self.trace, index, request.arrival_s)
        # As if preempted after its first token: its prompt is the prompt and that token,
        # all of whose KV but the token's own arrives ready.
        rest.gen_sync = 1
        rest.transferred = request.prompt_len
        for carried in ("admitted_s", "first_token_s", "last_token_s", "preemptions",
                        "hit_tokens", "recomputed_tokens", "first_arrival_s", "attempts",
                        "siblings"):
            setattr(rest, carried, getattr(request, carried))
        transfer_s = self._transfer_tokens(decode, request.prompt_len) * (
            self.transfer_s_per_token)
        # Layer by layer, the transfer runs under the step (never ending before it: the
        # last layer's KV leaves after it is computed).
        sent_s = step_start_s + with_transfer(now_s - step_start_s, transfer_s,
                                              self.transfer_layers)
        heapq.heappush(prefill.held, (sent_s, index, request))  # its KV stays until sent
        arrival_s = sent_s + self.transfer_latency_s
        if self.least_loaded_decode:
            self.decode_in_flight[position] += 1
        self.release(decode, arrival_s, index, rest)

    def tell_router(self, replica: _Replica, batch: Batch, now_s: float) -> None:
        """Tell the router which requests ``replica`` seated or preempted in the step of
        ``batch`` (each one's last move in it) and which prompts it finished reading (their
        first token is out): all at the step's end, ``now_s``, as it learns of finishes and
        as vLLM's engines publish their waiting and running counts after each step."""
        router = self.router
        if router is None:
            return
        if batch.seatings:
            moves = {request.index: (request, seated) for request, seated in batch.seatings}
            for request, seated in moves.values():
                if seated:
                    router.admitted(self.router_key(request), replica.index, now_s)
                else:
                    router.preempted(self.router_key(request), replica.index, now_s)
        for request, _, _ in batch.prefill:
            if not request.in_prefill and self._seen_by_router(request):
                router.prefilled(self.router_key(request), replica.index, now_s)

    def _seen_by_router(self, request: Request) -> bool:
        """Whether the router knows ``request`` as a request of its own: always, but a
        sample of a request the router sees whole other than its first."""
        first = self.first_sample
        return not self.router_sees_requests or first is None or (
            request.index == first[request.index])

    def _tell_router_done(self, replica: _Replica, request: Request, now_s: float) -> None:
        """``request`` is done on ``replica`` at ``now_s``: the router sees it finish, or,
        where it sees requests whole, the request once its last sample of the try is."""
        router = self.router
        assert router is not None
        first, request_of = self.first_sample, self.request_of
        if not self.router_sees_requests or first is None or request_of is None:
            router.finished(self.router_key(request), replica.index, now_s)
            return
        this_try = (int(request_of[request.index]), request.attempts)
        left = self.samples_out.get(this_try, self.samples_of[this_try[0]]) - 1
        if left:
            self.samples_out[this_try] = left
            return
        self.samples_out.pop(this_try, None)
        leader = int(first[request.index])
        router.finished(leader + (request.attempts - 1) * len(self.arrival_s), replica.index,
                        now_s)

    def router_key(self, request: Request) -> int:
        """Who ``request`` is to the router: its index; each retry of it a request of its
        own, numbered past every first try (a retry is expected before the router has
        applied the end of the try before)."""
        return request.index + (request.attempts - 1) * len(self.arrival_s)

    def _last_sample(self, sample: Request, served: bool) -> bool:
        """Whether ``sample`` (``served``, or not), now done, was the last of its request's
        samples to be (always, where each request is one). A request whose client gave up
        on a sample gave up on all: what the others had was generated in vain."""
        if self.samples_left is None or self.request_of is None:
            return True
        request = int(self.request_of[sample.index])
        self.samples_left[request] -= 1
        if not self.mid_answer_time_out:
            return self.samples_left[request] == 0
        group = self.sample_groups.setdefault(request, _SampleGroup())
        if served:  # (its tokens count only if its siblings are served too)
            group.output_tokens += sample.gen_sync
            group.token_runs += sample.token_runs or ()
        group.given_up = group.given_up or sample.abandoned_s >= 0
        if self.samples_left[request]:
            return False
        del self.sample_groups[request]
        if group.given_up:
            self.abandoned_output_tokens += group.output_tokens
            self._in_vain(group.token_runs)
        return True

    def _in_vain(self, token_runs: list[tuple[list[int], int, int]]) -> None:
        """Take the tokens of ``token_runs``, received by a client who gave up, out of the
        ITL (vLLM's benchmark counts the requests served)."""
        for step_waits_us, first, stop in token_runs:
            self.vain_token_waits_us.update(step_waits_us[first:stop])

    def on_done(self, replica: _Replica, request: Request, now_s: float,
                step_start_s: float | None = None) -> None:
        """A request finished (in the step from ``step_start_s``), was rejected or shed, or
        was given up by its client: record it (unless its client tries again), release
        whoever waits on it."""
        if self.least_loaded_decode and replica.role == "decode":
            heapq.heappush(self.decode_done, (now_s, replica.index - self.prefill_replicas))
        if request.siblings is not None and request in request.siblings.members:
            request.siblings.members.remove(request)  # (its try is over)
        if self.router is not None and not request.rejected and replica.role != "decode":
            self._tell_router_done(replica, request, now_s)
        served = not (request.rejected or request.shed) and request.abandoned_s < 0
        if replica.role == "prefill" and served and self.output_lens[request.index] > 1:
            self._hand_over(replica, request, now_s,
                            now_s if step_start_s is None else step_start_s)
            return
        if replica.role == "prefill" and served:
            replica.scheduler.release(request)  # one token: nothing to send on
        if request.discarded_output:
            self.discarded_output_tokens += request.discarded_output * request.n
        if request.abandoned_s >= 0:
            self.abandoned_output_tokens += (
                request.gen_sync + request.discarded_output) * request.n
        if request.token_runs is not None and request.abandoned_s >= 0:
            self._in_vain(request.token_runs)
        if self.sample_tries is not None and self._settled_with_its_try(
                replica, request, now_s, served):
            return
        if (request.abandoned_s >= 0 or request.shed) and self._retry(replica, request, now_s):
            return
        self._record(replica, request, now_s, served)

    def _settled_with_its_try(self, replica: _Replica, request: Request, now_s: float,
                              served: bool) -> bool:
        """Whether ``request``, a sample done (``served``, or given up), is settled with the
        other samples of its try (see :class:`_SampleTry`): waiting for them, done in time,
        or sent again with them, its tokens in vain, the client having given up on another.
        If not, record it (or send it again) as any request."""
        if self.request_of is None or self.sample_tries is None or not (
                served or request.abandoned_s >= 0):
            return False  # (turned away: every sample of the try alike)
        of = int(self.request_of[request.index])
        key = (of, request.attempts)
        this_try = self.sample_tries.get(key) or _SampleTry(self.samples_of[of])
        this_try.pending -= 1
        if this_try.pending:
            self.sample_tries[key] = this_try
        else:
            self.sample_tries.pop(key, None)
        if served and this_try.given_up_s < 0:
            if this_try.pending:  # done in time: it waits for the others
                this_try.held.append((replica, request, now_s))
                return True
            for held in this_try.held:  # all done in time: the client has them all
                self._record(*held, True)
            return False
        if this_try.given_up_s < 0:  # the first the client gave up on: it gives up on all
            this_try.given_up_s = request.abandoned_s
            this_try.resent = self._retry(replica, request, now_s)
            for held_replica, sample, held_s in this_try.held:
                if this_try.resent:
                    self._resend_done(held_replica, sample, this_try.given_up_s, now_s)
                else:
                    self._record(held_replica, sample, held_s, True)
            this_try.held = []
            return this_try.resent
        if this_try.resent and served:  # done, but only after the client gave up
            self._resend_done(replica, request, this_try.given_up_s, now_s)
        return this_try.resent and (served or self._retry(replica, request, now_s))

    def _resend_done(self, replica: _Replica, sample: Request, given_up_s: float,
                     now_s: float) -> None:
        """Send ``sample``, done, again with the other samples of its try, whose client gave
        up on them at ``given_up_s``: the tokens it had are in vain."""
        self.abandoned_output_tokens += sample.gen_sync + sample.discarded_output
        if sample.token_runs is not None:
            self._in_vain(sample.token_runs)
        sample.abandoned_s = given_up_s
        resent = self._retry(replica, sample, now_s)
        assert resent, "the samples of a try are sent again together"

    def _record(self, replica: _Replica, request: Request, now_s: float,
                served: bool) -> None:
        """Record ``request``, done for good at ``now_s``, and release whoever waits on
        it."""
        last_sample = self.samples_left is None or self._last_sample(request, served)
        request.token_runs = None
        routed_to = int(self.replica_of[request.index])
        row: tuple[object, ...] = (
            request.index, request.first_arrival_s, request.admitted_s, request.first_token_s,
            request.finished_s, request.prompt_len, self.output_lens[request.index],
            request.n, request.priority, request.preemptions, request.hit_tokens,
            request.recomputed_tokens, request.rejected, request.shed, request.abandoned_s,
            request.attempts,
            routed_to, int(self.allocated_at_finish[request.index]), request.max_itl_s)
        if self.handovers:
            row += (replica.index if replica.role == "decode" else -1,)
        self.request_rows.append(row)
        self.done += 1
        if self.progress and last_sample:
            self.progress(1)
        dependents = self.dependents.get(request.index)
        if not dependents:
            return
        # A session's next turn goes where its conversation's prompts are read.
        home = self.replicas[routed_to]
        for index in dependents:
            release = now_s + self.think_s[index]
            if self.duration_s is not None and release > self.duration_s:
                continue
            self.release(home, release, index)
            self.replica_of[index] = home.index  # (where a retry of the last turn went)
            if self.router is not None:
                turn = self.new_request(index, release, home)
                if self.accepts(home, turn):
                    self.router.expect(index, home.index, release, turn.prompt_segments)

    def _retry(self, replica: _Replica, request: Request, now_s: float) -> bool:
        """Whether the client of ``request``, given up or turned away (at ``now_s``, seen by
        ``replica`` at its clock), sends it again after its back-off (not past the stop's
        duration): if so, it is on its way, and nothing is recorded yet. The retry goes
        through the balancer as a new request: to the next replica in turn after the one
        that had it, or where the router places it (a prefill replica, under
        disaggregation, if a decode replica was answering)."""
        retry = self.retry
        if retry is None or request.attempts > retry.max_retries:
            return False
        # A draw of each client's own, the same whatever else the run does (the samples of
        # a request fanned out are sent again together).
        index = request.index
        client = index if self.request_of is None else int(self.request_of[index])
        draw = random.Random(f"kvsim retry {self.seed} {client} {request.attempts}")
        failed_s = request.abandoned_s if request.abandoned_s >= 0 else now_s
        again_s = failed_s + retry.delay_s(request.attempts, draw.random())
        if self.duration_s is not None and again_s > self.duration_s:
            return False
        again = Request(self.trace, index, again_s)
        again.first_arrival_s = request.first_arrival_s
        again.attempts = request.attempts + 1
        self._share_waits(again)
        # Another replica takes the retry in when it is sent or, if the engine learns of
        # the failure only later (at the step boundary after a time-out), then: never
        # before what that replica has taken in already (its back-off counts from the
        # failure all the same).
        join_s = max(again_s, now_s, replica.clock) if self.reroutes else again_s
        if self.router is not None and self.reroutes:
            # Placed among the open arrivals in time order (never among those the router
            # has placed already).
            heapq.heappush(self.retry_stream, (join_s, index, again))
            for other in self.replicas[:self.routed_replicas]:  # (one may place it in time)
                other.wake_if_idle()
            return True
        # (Itself, if alone.)
        target = self.replicas[(int(self.replica_of[index]) + 1) % self.routed_replicas]
        self.replica_of[index] = target.index
        self.release(target, join_s, index, again)
        if self.router is not None and self._seen_by_router(again):
            self.router.expect(self.router_key(again), target.index, again_s,
                               again.prompt_segments)
        return True

    def run(self) -> RunResult:
        for replica in self.replicas:
            if self.router is None:  # routed replicas wake at every open arrival anyway
                self.env.process(replica.arrivals())
        # Memory fractions are of a decode (or colocated) replica's pool: another pool's
        # slots count in proportion.
        reference = self.replicas[self.prefill_replicas].allocator.capacity_slots
        for replica in self.replicas:
            replica.pool_scale = reference / replica.allocator.capacity_slots
        # An engine of D ranks steps them together; one of one rank is a replica alone.
        first = 0
        while first < len(self.replicas):
            ranks = self.replicas[first].setup.ranks
            if ranks > 1:
                group = _RankGroup(self.env, self.replicas[first:first + ranks],
                                   cuda_graph_tokens(self.system))
                self.rank_groups.append(group)
                self.env.process(group.run())
            else:
                self.env.process(self.replicas[first].run())
            first += ranks
        self.env.run()
        if self.env.now > MAX_TIME_S:
            # Arrivals and waits are bounded there; steps this slow come of a GPU's or a
            # model's numbers, and past about 1e15 s a float clock stands still.
            raise SizingError(f"system {self.system.name!r}: the run's clock reached "
                              f"{self.env.now:.3g} s, past {MAX_TIME_S:,.0f} s (31 years): "
                              "its steps take that long; check the GPU's and the model's "
                              "numbers")
        for replica in self.replicas:
            if any(sched.running or sched.waiting for sched in replica.schedulers):
                raise SimulationError(f"replica {replica.index} stopped with work left")
        return self._result()

    def _result(self) -> RunResult:
        # Dependents whose release fell after the stop never ran and have no row.
        requests = self.request_rows.frame().sort_values("request", kind="stable")
        requests = requests.reset_index(drop=True)
        for column in ("admitted_s", "first_token_s", "finished_s", "abandoned_s", "max_itl_s"):
            requests[column] = requests[column].where(requests[column] >= 0)
        if self.request_of is not None:
            requests = gather_samples(requests, self.request_of)
        requests["finished_s"] = requests["finished_s"].astype(float)
        steps = self.recorder.steps.frame()
        memory = self.recorder.memory.frame()
        capacity = self.replicas[self.prefill_replicas].allocator.capacity_slots
        schedulers = [sched for r in self.replicas for sched in r.schedulers]
        token_waits_us: Counter[int] = Counter()
        for sched in schedulers:
            token_waits_us.update(sched.token_waits_us)
        token_waits_us.subtract(self.vain_token_waits_us)
        assert min(token_waits_us.values(), default=0) >= 0, "a token taken out twice"
        token_waits_us = +token_waits_us  # (the waits only given-up requests' tokens had)
        lookup = sum(s.lookup_tokens for s in schedulers)
        hits = sum(s.hit_tokens for s in schedulers)
        preempted_lookup = sum(s.preempted_lookup_tokens for s in schedulers)
        preempted_hits = sum(s.preempted_hit_tokens for s in schedulers)
        extra = {"lookup_tokens": lookup, "hit_tokens": hits,
                 "preempted_lookup_tokens": preempted_lookup,
                 "preempted_hit_tokens": preempted_hits,
                 "prefix_caching": bool(getattr(self.replicas[0].allocator,
                                                "enable_prefix_caching", False)),
                 "evictions": sum(getattr(getattr(r.allocator, "pool", None), "num_evictions", 0)
                                  for r in self.replicas),
                 "replicas": len(self.replicas),
                 # Over the replicas new requests go to (prefill replicas, if split).
                 "replica_imbalance": _imbalance(requests["replica"],
                                                 self.prefill_replicas or len(self.replicas)),
                 "prefill_replicas": self.prefill_replicas,
                 "gpus": self.gpus,
                 "usd_per_gpu_hour": self.usd_per_gpu_hour,
                 "state_slots_per_sequence": self.replicas[0].allocator.state_slots_per_sequence,
                 **token_wait_summary(token_waits_us)}
        loaded = sum(s.first_loaded_tokens for s in schedulers)
        # None (shown "—") without a host tier, as the hit rate without a prefix cache.
        has_host = getattr(self.replicas[0].allocator, "host", None) is not None
        extra["host_hit_rate"] = (loaded / lookup if lookup else 0.0) if has_host else None
        extra["host_loaded_tokens"] = sum(s.loaded_tokens for s in schedulers)
        # None (shown "—") for systems that preempt by recompute.
        swaps = self.system.scheduler.swaps
        for key in ("swap_preemptions", "swapped_out_slots", "swapped_in_slots"):
            extra[key] = (sum(getattr(s, key) for s in schedulers) if swaps
                          else None)
        # None (shown "—") without data-parallel ranks: their time waiting on slower ones.
        busy_s = sum(group.busy_s for group in self.rank_groups)
        extra["rank_wait_frac"] = (sum(group.waited_s for group in self.rank_groups) / busy_s
                                   if busy_s else 0.0) if self.rank_groups else None
        # None (shown "—") without pipeline stages: their time idle while a batch was in
        # flight (filling, draining, waiting on a slower stage or on the CPU).
        stages = len(self.decode_setup.stage_shares)
        in_flight_s = sum(r.in_flight_s for r in self.replicas)
        extra["pipeline_bubble_frac"] = (
            1.0 - sum(r.stage_busy_s for r in self.replicas) / (stages * in_flight_s)
            if in_flight_s else 0.0) if stages > 1 else None
        # None (shown "—") without speculative decoding: the drafts a decode step verified.
        decoding = steps[steps["decode_seqs"] > 0]
        extra["mean_draft_tokens"] = (
            float((decoding["draft_tokens"] * decoding["steps"]).sum() / decoding["steps"].sum())
            if len(decoding) else 0.0) if self.system.speculative else None
        # The K by batch size an auto schedule chose (None for any other).
        schedule = self.decode_setup.auto_schedule
        extra["draft_schedule"] = json.dumps(schedule) if schedule is not None else None
        # None (shown "—") but under SGLang's admission.
        extra["reserve_holds"] = (
            sum(s.reserve_holds for s in schedulers)
            if self.system.scheduler.admission == "new_token_ratio" else None)
        # None (shown "—") but for a contiguous reservation sized by a predictor.
        extra["reservation_overflows"] = (
            sum(s.reservation_overflows for s in schedulers)
            if self.system.predicts_reservations else None)
        # None (shown "—") where clients wait for ever (no workload.queue_timeout_s,
        # ttft_timeout_s, e2e_timeout_s or itl_timeout_s); of them, those aborted while
        # seated, their prompts' work lost (None where only a seat is waited for); and the
        # output tokens generated in vain (None but where clients may leave mid-answer).
        abandoned = requests["abandoned_s"].notna()
        extra["abandoned"] = int(abandoned.sum()) if self.clients_give_up else None
        extra["abandoned_seated"] = (
            int((abandoned & requests["admitted_s"].notna()).sum())
            if self.seated_time_out else None)
        extra["abandoned_output_tokens"] = (self.abandoned_output_tokens
                                            if self.mid_answer_time_out else None)
        extra["discarded_output_tokens"] = (self.discarded_output_tokens if self.forks
                                            else None)
        extra["retries"] = (int((requests["attempts"] - 1).sum())
                            if self.retry is not None else None)
        # None (shown "—") where the line is unbounded (no scheduler.max_queued_requests).
        extra["shed"] = (int(requests["shed"].sum())
                         if self.system.scheduler.max_queued_requests is not None else None)
        summary_requests = requests.fillna({"finished_s": -1.0})
        summary = summarize(summary_requests, steps,
                            self.recorder.averages(), capacity, extra,
                            self.slo)
        return RunResult(self.system.name, requests, memory, steps, summary)


def _imbalance(replica_column: pd.Series, replicas: int) -> float:
    """Requests on the busiest replica over the mean per replica (1: perfectly even)."""
    counts = np.bincount(replica_column.to_numpy(dtype=np.int64), minlength=replicas)
    return float(counts.max() / counts.mean()) if counts.sum() else 1.0


def scenario_pool_slots(scenario: Scenario) -> int:
    """Token slots in one replica's KV pool, as the scenario's model, GPU and memory
    settings size it."""
    return kv_pool_slots(scenario.model_spec(), scenario.gpu_spec(),
                         kv_memory_gib=scenario.memory.kv_memory_gib,
                         gpu_memory_utilization=scenario.memory.gpu_memory_utilization,
                         tensor_parallel_size=scenario.parallel.tensor_parallel_size,
                         data_parallel_size=scenario.parallel.data_parallel_size,
                         pipeline_parallel_size=scenario.parallel.pipeline_parallel_size)


# Each block (or page) costs the simulator about 120 bytes of host memory; 2^25 of them is
# ~4 GiB, and more blocks than any GPU holds (an H200 holds ~1.1 M of Llama-2-7B's 16-token
# blocks), so a larger pool is a typing slip that would otherwise end in an out-of-memory kill.
# The cap holds for a system's pools taken together too: every replica (and rank) holds its
# own, all at once.
MAX_POOL_BLOCKS = 1 << 25
# A contiguous pool costs nothing per slot, but its slots are counted in int64 columns; 2^33
# is the most a paged pool holds (2^25 blocks of 256), and ~8,000 times an H200's worth.
MAX_POOL_SLOTS = MAX_POOL_BLOCKS * 256


def pool_blocks(scenario: Scenario, system: SystemConfig, pool_slots: int) -> int:
    """Blocks (or pages) a pool of ``pool_slots`` holds for ``system``, each costing the
    simulator host memory; 0 for contiguous memory (extents: its cost grows with the
    requests, not the pool)."""
    if isinstance(system.allocator, ContiguousConfig):
        return 0
    unit = allocation_unit(scenario, system)
    model = cached_model(scenario, system)
    if uses_hybrid_kv_cache(model, system):  # a block spans one group's layers
        return pool_slots * model.kv_layers // (model.kv_cache_groups()[0] * unit)
    return pool_slots // unit


def _pool_source(scenario: Scenario) -> str:
    """The field that sized the pool, for an error."""
    return ("memory.kv_memory_gib" if scenario.memory.kv_memory_gib is not None
            else "memory (the GPU's memory_gib)")


def check_pool(scenario: Scenario, system: SystemConfig, pool_slots: int) -> None:
    """Refuse a pool of ``pool_slots`` that holds not one token, or not one block (or page)
    of ``system``, or more blocks than :data:`MAX_POOL_BLOCKS` or slots than
    :data:`MAX_POOL_SLOTS`."""
    if pool_slots < 1:
        model = scenario.model_spec()
        raise SizingError(f"memory: the KV pool holds not one token ({model.name} takes "
                          f"{model.kv_bytes_per_token:,} bytes a token)")
    unit = allocation_unit(scenario, system)
    if pool_slots < unit:
        what = "page" if isinstance(system.allocator, VirtualConfig) else "block"
        raise SizingError(f"memory: the KV pool ({pool_slots} slots) is smaller than one {what} "
                          f"({unit} slots) of system {system.name!r}")
    blocks = pool_blocks(scenario, system, pool_slots)
    if blocks > MAX_POOL_BLOCKS:
        what = "pages" if isinstance(system.allocator, VirtualConfig) else "blocks"
        raise SizingError(f"{_pool_source(scenario)}: the KV pool of system {system.name!r} "
                          f"would hold {blocks:,} {what} of {unit} tokens; at most "
                          f"{MAX_POOL_BLOCKS:,} are simulated: give a smaller pool or a larger "
                          f"block size")
    if pool_slots > MAX_POOL_SLOTS:
        raise SizingError(f"{_pool_source(scenario)}: the KV pool of system {system.name!r} "
                          f"would hold {pool_slots:,} token slots; at most {MAX_POOL_SLOTS:,} "
                          f"are simulated: give a smaller pool")


def check_pools(scenario: Scenario, system: SystemConfig) -> tuple[int, int]:
    """Check every KV pool ``system`` runs (:func:`check_pool`) and refuse more blocks in
    all, over every replica and rank, than :data:`MAX_POOL_BLOCKS`. The slots of a decode
    pool and of a prefill pool (the same pool without disaggregation)."""
    decode_slots = system_pool_slots(scenario, system)
    check_pool(scenario, system, decode_slots)
    view = scenario.prefill_view()
    prefill_slots = decode_slots
    if view is not scenario:  # prefill replicas spread over GPUs otherwise
        prefill_slots = system_pool_slots(view, system)
        check_pool(view, system, prefill_slots)
    prefill_ranks = scenario.prefill_ranks
    decode_ranks = scenario.ranks - prefill_ranks
    decode_blocks = pool_blocks(scenario, system, decode_slots)
    prefill_blocks = pool_blocks(view, system, prefill_slots)
    total = decode_ranks * decode_blocks + prefill_ranks * prefill_blocks
    if total > MAX_POOL_BLOCKS:
        what = "pages" if isinstance(system.allocator, VirtualConfig) else "blocks"
        engines = "ranks" if scenario.ranks != scenario.engine.replicas else "replicas"
        if not prefill_ranks:
            pools = f"its {decode_ranks:,} {engines}, {decode_blocks:,} each"
        elif prefill_blocks == decode_blocks:
            pools = (f"its {prefill_ranks:,} prefill and {decode_ranks:,} decode {engines}, "
                     f"{decode_blocks:,} each")
        else:
            pools = (f"its {prefill_ranks:,} prefill {engines}, {prefill_blocks:,} each, and "
                     f"{decode_ranks:,} decode {engines}, {decode_blocks:,} each")
        raise SizingError(f"engine.replicas: system {system.name!r} would hold {total:,} "
                          f"{what} over {pools}; at most {MAX_POOL_BLOCKS:,} are simulated in "
                          f"all: give fewer replicas, a smaller pool or a larger block size")
    return decode_slots, prefill_slots


def memory_summary(scenario: Scenario) -> str:
    """How a replica's GPU memory divides, in the figures vLLM logs as it starts ("GPU KV
    cache size", "Maximum concurrency for N tokens per request"), to check a scenario
    against a real deployment. Pools the engine would refuse are refused here too
    (:func:`check_pools`), so that ``kvsim validate`` says so."""
    for system in scenario.systems:
        check_pools(scenario, system)
    return _memory_text(scenario)


def _memory_text(scenario: Scenario) -> str:
    """:func:`memory_summary`'s line for a scenario, or for the view its prefill replicas
    have of it."""
    model, gpu = scenario.model_spec(), scenario.gpu_spec()
    tp = scenario.parallel.tensor_parallel_size
    slots = scenario_pool_slots(scenario)
    parallel = scenario.parallel
    # Under pipeline parallelism, the heaviest stage's GPUs (which set the pool).
    stage_layers = model.pipeline_stage_layers(parallel.pipeline_parallel_size)
    stage_share = max(stage_layers) / model.num_layers
    per_gpu = model.kv_bytes_per_token_per_gpu(tp) * stage_share
    gpus = gpu.name if tp == 1 else f"{tp} × {gpu.name}"
    rank = ""
    if parallel.data_parallel_size > 1:
        gpus = f"{parallel.data_parallel_size} data-parallel ranks of {gpus}"
        rank = " a rank"
    if parallel.pipeline_parallel_size > 1:
        gpus = (f"{parallel.pipeline_parallel_size} pipeline stages of {gpus} "
                f"({'/'.join(map(str, stage_layers))} layers; the figures a GPU are the "
                "heaviest stage's)")
    if parallel.spreads_experts:
        gpus += (f" (experts {'whole' if parallel.expert_parallel else 'split'} over "
                 f"{parallel.stage_gpus} GPUs)")
    each = "" if parallel.gpus == 1 else " a GPU"
    source = (" (memory.kv_memory_gib)" if scenario.memory.kv_memory_gib is not None else
              f" ({scenario.memory.gpu_memory_utilization:.0%} of GPU memory less the weights)")
    weight_gib = model.weight_bytes_per_gpu(tp, parallel.stage_gpus) * stage_share / GIB
    text = (f"memory: {model.name} on {gpus}: weights {weight_gib:.1f} GiB"
            f"{each}, KV pool {slots * per_gpu / GIB:.1f} GiB{each}{source}; GPU KV cache size "
            f"{slots:,} tokens{rank} of {per_gpu / 1024:,.1f} KiB{each}; maximum concurrency "
            f"for {model.max_model_len:,} tokens per request: "
            f"{max_concurrency(model, slots, model.max_model_len, tp):.2f}x{rank}")
    # A state-space hybrid's systems under mamba cache mode all take larger blocks.
    every_state = model.has_state_layers and any(caches_every_state(system)
                                                 for system in scenario.systems)
    if every_state:
        text += (f" ({max_concurrency(model, slots, model.max_model_len, tp, True):.2f}x "
                 "under mamba_cache_mode all)")
    if slots < model.max_model_len:
        text += (" (under 1x: vLLM would refuse to start, as the pool cannot hold one request "
                 "of the whole context; set max_model_len lower, or give the pool more memory)")
    if model.sliding_window:
        layers, full, sliding, _ = model.kv_cache_groups()
        text += (f"; a {model.sliding_window:,}-token sliding window in "
                 f"{model.num_sliding_layers} of {model.num_layers} layers: the hybrid KV cache "
                 f"manager keeps {full} full-attention and {sliding} sliding-window group"
                 f"{'s' if sliding > 1 else ''} of {layers} layer{'s' if layers > 1 else ''}")
    if model.has_state_layers:
        layers, full, _, state = model.kv_cache_groups()
        state_mib = model.state_bytes_per_layer_per_gpu(tp) * model.num_state_layers / MIB
        all_mode = (f" ({model.state_block_size(tp, True)} under mamba_cache_mode all)"
                    if every_state else "")
        text += (f"; {model.num_state_layers} of {model.num_layers} layers are state-space "
                 f"layers, keeping {state_mib:,.1f} MiB{each} of state a sequence instead of "
                 f"KV: paged, the hybrid KV cache manager keeps {full} full-attention and "
                 f"{state} state group{'s' if state > 1 else ''} of {layers} "
                 f"layer{'s' if layers > 1 else ''}, in "
                 f"blocks of at least {model.state_block_size(tp)} tokens{all_mode} (vLLM's "
                 f"block size raised so that a block holds a sequence's state in a layer); "
                 f"contiguous, "
                 f"each extent holds it in {model.state_slots_per_sequence(tp):,} slots more")
    view = scenario.prefill_view()
    if view is not scenario:  # prefill replicas spread otherwise: their line too
        text += "; prefill replicas: " + _memory_text(view).removeprefix("memory: ")
    for system in scenario.systems:
        if system.speculative is not None:
            text += _drafted_memory_text(scenario, system, slots)
    return text


def _drafted_memory_text(scenario: Scenario, system: SystemConfig, slots: int) -> str:
    """What speculative decoding changes in :func:`_memory_text`'s figures for ``system``:
    the tokens its drafter's weights and KV leave, and the layout of a hybrid model's groups
    and states (empty where nothing changes)."""
    spec = system.speculative
    assert spec is not None
    model, tp = scenario.model_spec(), scenario.parallel.tensor_parallel_size
    parts = []
    system_slots = system_pool_slots(scenario, system)
    if system_slots != slots:
        draft = spec.drafter_spec(model)
        layers = spec.drafter_layers
        if draft is None:
            drafter = f"{spec.method} drafter's {layers} layer{'s' if layers > 1 else ''}"
        elif spec.draft_model is None:
            drafter = f"dense {spec.method} head of {draft.num_params / 1e9:.2f}B parameters"
        else:
            drafter = f"draft model {draft.name}"
        parts.append(f"its {drafter} (weights and KV) leave {system_slots:,} tokens")
    kv_model = cached_model(scenario, system)
    if kv_model.kv_layers != model.kv_layers and uses_hybrid_kv_cache(model, system):
        layers, full, sliding, state = kv_model.kv_cache_groups()
        kinds = [f"{full} full-attention"] + [
            f"{count} {kind}" for count, kind in ((sliding, "sliding-window"),
                                                 (state, "state")) if count]
        parts.append(f"the hybrid KV cache manager keeps {kv_model.kv_layers} attention "
                     f"layers, the drafter's among them, in {' and '.join(kinds)} groups of "
                     f"{layers} layers")
    if model.has_state_layers:
        states = states_per_sequence(system)
        each = "" if scenario.parallel.gpus == 1 else " a GPU"
        where = (f"in blocks of at least "
                 f"{kv_model.state_block_size(tp, caches_every_state(system))} tokens"
                 if uses_hybrid_kv_cache(model, system) else
                 f"in {extent_state_slots(kv_model, system, tp):,} slots an extent")
        state_mib = kv_model.state_bytes_per_layer_per_gpu(tp) / MIB
        parts.append(f"{states} states a sequence in each state-space layer (its own and "
                     f"one after each draft), {state_mib:,.2f} MiB each{each}, {where}")
    if not parts:
        return ""
    return f"; system {system.name!r}: " + ", ".join(parts)


def run_system(scenario: Scenario, system: SystemConfig, trace: Trace, timing: StepTimeModel,
               progress: Callable[[int], None] | None = None, base_dir: Path = Path()
               ) -> RunResult:
    """Simulate one system on ``trace`` (files the scenario names relative to
    ``base_dir``)."""
    pool_slots, prefill_slots = check_pools(scenario, system)
    smallest = int(final_kv_tokens(trace.prompt_len, trace.output_len).min())
    if pool_slots < smallest:
        raise SizingError(f"memory: the KV pool ({pool_slots} slots) is smaller than the "
                          f"smallest request ({smallest} tokens)")
    # vLLM v1 runs a request's samples as requests of their own: the engine sees those, and
    # the results gather them back into their request's row.
    request_of: np.ndarray | None = None
    if system.scheduler.parallel_sampling == "fan_out" and len(trace) and trace.n.max() > 1:
        samples = int(trace.n.sum())
        if samples > MAX_REQUESTS:
            raise WorkloadError(f"systems[{system.name}].scheduler.parallel_sampling: fan_out: "
                                f"{len(trace):,} requests of up to {int(trace.n.max()):,} "
                                f"samples make {samples:,} requests of their own, past the "
                                f"{MAX_REQUESTS:,} simulated: give fewer requests or samples")
        try:
            trace, request_of = trace.fan_out()
        except TraceError as exc:
            raise WorkloadError(f"systems[{system.name}].scheduler.parallel_sampling: fan_out: "
                                f"{exc}") from None
    decode = _RoleSetup.build(scenario, system, trace, timing, pool_slots, base_dir)
    prefill = decode
    view = scenario.prefill_view()
    if view is not scenario:  # prefill replicas spread over GPUs otherwise
        prefill = _RoleSetup.build(view, system, trace, build_timing(view, base_dir),
                                   prefill_slots, base_dir)
    return _SystemRun(scenario, system, trace, decode, prefill, progress, request_of).run()


def gather_samples(samples: pd.DataFrame, request_of: np.ndarray) -> pd.DataFrame:
    """The rows of samples run as requests of their own (parallel_sampling fan_out) as
    rows of their requests: seated with the first, a first token with the first, finished
    with the last (unfinished while one is), their preemptions, hits, recomputed tokens and
    memory summed, the longest gap of any (each sample streams its own tokens); the
    replicas of the first sample."""
    samples = samples.assign(request=request_of[samples["request"].to_numpy()])
    groups = samples.groupby("request", sort=True)
    first = groups.first()
    rows = pd.DataFrame({
        "arrival_s": first["arrival_s"],
        "admitted_s": groups["admitted_s"].min(),
        "first_token_s": groups["first_token_s"].min(),
        "finished_s": groups["finished_s"].max().where(
            groups["finished_s"].count() == groups.size()),
        "prompt_len": first["prompt_len"],
        "output_len": first["output_len"],
        "n": pd.Series(np.bincount(request_of), name="n").reindex(first.index),
        "priority": first["priority"],
        **{column: groups[column].sum() for column in (
            "preemptions", "prefix_hit_tokens", "recomputed_tokens")},
        **{column: groups[column].any() for column in ("rejected", "shed")},
        "abandoned_s": groups["abandoned_s"].min(),
        "attempts": groups["attempts"].max(),
        "replica": first["replica"],
        "allocated_at_finish": groups["allocated_at_finish"].sum(),
        "max_itl_s": groups["max_itl_s"].max(),
        **({"decode_replica": first["decode_replica"]} if "decode_replica" in samples else {}),
    })
    return rows.reset_index().astype({column: samples[column].dtype for column in samples})


def read_workload_files(scenario: Scenario, base_dir: Path) -> None:
    """Read the files a scenario's workload reads, as its run would, and refuse them as it
    would: a trace file row by row, or the files its empirical lengths resample (a synthetic
    workload's requests are not drawn: that may take long)."""
    workload = scenario.workload
    if isinstance(workload, SyntheticWorkload):
        workload.length_notes(base_dir)
        # Every drawn request has the workload's samples: the first stands for them all.
        _samples_run(scenario, np.array([workload.sampling.forks]), "synthetic")
    else:
        scenario_trace(scenario, base_dir)


def scenario_trace(scenario: Scenario, base_dir: Path, seed: int | None = None) -> Trace:
    """The trace a scenario replays against every system."""
    trace = build_trace(scenario.workload, seed=scenario.seed if seed is None else seed,
                        max_model_len=scenario.model_spec().max_model_len,
                        num_requests=scenario.stop.num_requests,
                        duration_s=scenario.stop.duration_s, base_dir=base_dir)
    judged = scenario.slo.priorities if scenario.slo else None
    if judged and not np.isin(trace.priority, judged).any():
        levels = ", ".join(str(level) for level in np.unique(trace.priority))
        raise WorkloadError(f"slo.priorities: no request has priority "
                            f"{', '.join(map(str, judged))}; the trace's levels: {levels}")
    _samples_run(scenario, trace.n, trace.source)
    unpredicted = np.flatnonzero(trace.predicted_output < 1)
    for system in scenario.systems:
        if (len(unpredicted) and system.uses_predictor
                and system.length_predictor.source == "trace"):
            raise WorkloadError(
                f"systems[{system.name}].predictor.source: trace, but request "
                f"{unpredicted[0]} of {trace.source} has no predicted_output (map the column "
                "that holds them with workload.columns.predicted_output)")
    return trace


def _samples_run(scenario: Scenario, samples: np.ndarray, source: str) -> None:
    """Refuse requests of several samples (``samples``: each request's, of the trace
    ``source`` names) that a system cannot run as it is told to: forks of a state-space
    model's states, more than fork runs together, contiguous forks beside capped prompt
    chunks, forks under SGLang's admission, or fanned out beside what is not modelled
    so."""
    if not len(samples) or samples.max() == 1:
        return
    unmodelled = scenario.fanned_out_samples_unmodelled()
    model = scenario.model_spec()
    several = int(np.argmax(samples > 1))  # the first request of several samples
    for system in scenario.systems:
        mode = system.scheduler.parallel_sampling
        forks = mode == "fork"
        refusal: tuple[int, str] | None = None  # (the request that shows it, why)
        if forks and model.has_state_layers:
            refusal = several, (f", and {model.name}'s state-space layers keep a state a "
                                "sequence that forks would not share; use fan_out (each "
                                "sample a request of its own, as vLLM runs them)")
        elif forks and samples.max() > MAX_SAMPLES:
            refusal = int(np.argmax(samples > MAX_SAMPLES)), (
                f"; at most {MAX_SAMPLES} run together (fan_out runs more, each a request of "
                "its own)")
        elif (forks and isinstance(system.allocator, ContiguousConfig)
              and system.scheduler.long_prefill_token_threshold):
            # Forks find their extents when the prompt's last chunk is read; capped chunks
            # leave budget to seat others meanwhile, who may take that room.
            refusal = several, (", whose contiguous extents beside prompts read in capped "
                                "chunks (scheduler.long_prefill_token_threshold) are not "
                                "modelled; use fan_out (as vLLM, whose cap it is, runs "
                                "samples) or paged memory")
        elif forks and system.scheduler.admission == "new_token_ratio":
            refusal = several, (", whose forks SGLang's admission (scheduler.admission: "
                                "new_token_ratio) does not seat; use fan_out (each sample a "
                                "request of its own, as SGLang runs them)")
        elif not forks and unmodelled:
            refusal = several, f": {unmodelled}"
        if refusal is not None:
            request, why = refusal
            raise WorkloadError(f"systems[{system.name}].scheduler.parallel_sampling: {mode}: "
                                f"request {request} of {source} has "
                                f"{int(samples[request])} samples{why}")


@contextmanager
def _few_garbage_collections() -> Iterator[None]:
    """A run allocates millions of short-lived tuples and few reference cycles: collecting
    the young generation every 700 allocations (CPython's default) costs ~7 % for nothing."""
    saved = gc.get_threshold()
    gc.set_threshold(200_000, 50, 1000)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def run_scenario(scenario: Scenario, base_dir: Path = Path(),
                 progress: Callable[[str, int], Callable[[int], None] | None] | None = None,
                 ) -> ScenarioResult:
    """Generate the scenario's trace once and simulate every system on it."""
    trace = scenario_trace(scenario, base_dir)
    timing = build_timing(scenario, base_dir)
    systems = {}
    for system in scenario.systems:
        callback = progress(system.name, len(trace)) if progress else None
        with _few_garbage_collections():
            systems[system.name] = run_system(scenario, system, trace, timing, callback,
                                              base_dir)
    return ScenarioResult(scenario=scenario.model_dump(mode="json"), systems=systems,
                          trace_notes=list(trace.notes))


__all__ = ["SimulationError", "allocation_unit", "build_allocator", "build_timing",
           "kv_bytes_per_slot", "run_scenario", "run_system", "scenario_trace",
           "uses_hybrid_kv_cache"]
