"""How long one engine step takes: a linear model in the step's shape.

A step is a bus trip: a fixed cost to leave the depot (``a``: weights streamed from HBM once,
kernel launches), a fare per passenger (``b`` per decoding sequence), per kilometre of road
(``c`` per context token attention reads, times the paging overhead ρ(block_size)), per new
token prefilled (``d``) and for the prefill attention's quadratic part (``e`` per token pair)::

    T = a + b·B + ρ(bs)·c·C + d·P + e·S

B = decoding sequences, C = context tokens their attention reads, P = prefill tokens,
S = Σ p·(h + p) over prefill chunks (p new tokens on h already cached; p² for a fresh prompt).
A model's sliding-window layers read at most a window of each context: a share ``w`` of the
layers skips the context past it, so C becomes C − w·X and S becomes S − w·Y, where X and Y
are the context tokens and token pairs past the window (the scheduler counts them).

Under speculative decoding each decoding sequence feeds the step its k drafts too: they pass
through the model as prefill tokens do (``d`` each, in the batch ``a`` reads the experts
for), and the context C counts them; a drafter with coefficients of its own (a′ … e′: an
EAGLE or MTP head is a share of the target's layers, a draft model its own roofline) runs k
decode passes over the batch, and reads the step's new prompt tokens once (its weights too,
a′, where no pass of its own read them)::

    T += d·B·k + k·(a′ + b′·B + ρ(bs)·c′·C) + d′·P + e′·S     (+ a′ if B = 0 < P)

(A state-space hybrid's drafts each write one more state a sequence, in every state layer:
``draft_state_s`` more per draft and sequence.)

(With K drafts by batch size, k is the step's K; at K = 0 a drafter still makes one pass, as
vLLM runs it to keep the drafter's KV in step.)

Data-parallel ranks of a mixture of experts step together, as their MoE layers exchange
tokens: a round lasts as long as its slowest rank's step, in which the R tokens of all D
ranks choose the experts each GPU reads (in ``a``), and each GPU computes its experts' share
of their FLOPs, R/D tokens' worth, in place of its own tokens' (in ``b`` and ``d``).

Defaults are a roofline of the model on the GPU preset; a calibration YAML written by
``gpu_validate`` (format in :class:`Calibration`) replaces them with measured values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from sim.presets import KV_CACHE_DTYPES, GpuSpec, ModelSpec
from sim.yaml_file import read_yaml

DEFAULT_STEP_OVERHEAD_S = 1.0e-3  # scheduler + kernel launches per step, typical of vLLM
DEFAULT_PAGED_ALPHA = 2.0  # ρ(bs) = 1 + alpha/bs: +12.5% attention time at bs=16
# One small-message NCCL all-reduce inside an NVLink node: nccl-tests report ~10-30 µs
# for the KB-MB messages a decode step sends; the low end, as CUDA graphs run them.
DEFAULT_ALLREDUCE_LATENCY_S = 10e-6
# Pipeline stages on other boards send activations over the network: DGX H100/H200 boards
# give every GPU its own 400 Gb/s InfiniBand NIC, 50 GB/s a direction.
DEFAULT_PIPELINE_NETWORK_GBPS = 50.0


class CalibrationError(ValueError):
    """A calibration file that is missing, malformed or for another model."""


@dataclass(frozen=True)
class StepTimeModel:
    """Coefficients of the step-time model, in seconds per unit."""

    a: float
    b: float
    c: float
    d: float
    e: float
    # Measured ρ at some block sizes (interpolated in log2 block size); empty → 1 + alpha/bs.
    rho_table: dict[int, float] = field(default_factory=dict)
    paged_alpha: float = DEFAULT_PAGED_ALPHA
    source: str = "roofline"
    # A mixture of experts: the part of ``a`` that reads the routed experts, and the share
    # k/E of them each token goes to. A step reads only the experts its tokens choose.
    expert_s: float = 0.0
    expert_share: float = 0.0
    # Data parallelism: the ranks whose tokens every GPU's experts serve (a step's
    # ``round_tokens``, or each rank assumed to pass as many tokens as this one), and the
    # part of ``b`` and ``d`` that is the routed experts' FLOPs per token.
    expert_batch_ranks: int = 1
    expert_flops_s: float = 0.0
    # The share of the layers that attend to a sliding window only (their reads past it are
    # skipped); 0: every layer attends to every token.
    sliding_share: float = 0.0
    # Speculative decoding: drafts each decoding sequence adds to a step, and the drafter's
    # own coefficients (None: n-gram lookup, no model).
    speculative_tokens: int = 0
    drafter: StepTimeModel | None = None
    # A state-space hybrid: the part of ``b`` that reads and writes each decoding
    # sequence's state in the state layers, and what each of its drafts adds: the state
    # after that draft, written in every state layer (so that the accepted one's is kept).
    state_s: float = 0.0
    draft_state_s: float = 0.0

    def fixed_s(self, tokens: int, round_tokens: int = 0) -> float:
        """``a`` for a step that passes ``tokens`` tokens through the model: all of it, but
        for a mixture of experts only the experts they choose, each token k of E at random,
        so that a share 1 − (1 − k/E)^tokens of them is read (of every rank's tokens under
        data parallelism: ``round_tokens``, or this rank's times the ranks)."""
        if not self.expert_s:
            return self.a
        return self.a - self.expert_s * (1.0 - self.expert_share) ** (
            round_tokens or tokens * self.expert_batch_ranks)

    @property
    def min_fixed_s(self) -> float:
        """The least a step can take: one token's."""
        return self.fixed_s(1)

    def rho(self, block_size: int | None) -> float:
        """Paged-attention overhead factor; 1 for contiguous memory (``block_size`` None)."""
        if block_size is None:
            return 1.0
        if not self.rho_table:
            return 1.0 + self.paged_alpha / block_size
        sizes = sorted(self.rho_table)
        if block_size <= sizes[0]:
            return self.rho_table[sizes[0]]
        if block_size >= sizes[-1]:
            return self.rho_table[sizes[-1]]
        for lo, hi in itertools.pairwise(sizes):
            if lo <= block_size <= hi:
                w = (math.log2(block_size) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
                return self.rho_table[lo] * (1 - w) + self.rho_table[hi] * w
        raise AssertionError("unreachable")

    def step_time(self, decode_seqs: int, context_tokens: int, prefill_tokens: int,
                  prefill_pairs: int, rho: float, skipped_context: int = 0,
                  skipped_pairs: int = 0, round_tokens: int = 0) -> float:
        """Seconds for one step of the given shape (ρ already chosen for the allocator);
        ``skipped_context`` and ``skipped_pairs`` lie past a sliding window. Data-parallel
        ranks step together: ``round_tokens``, the tokens all of them pass through the step
        (0: as many on each as on this one), choose the experts this GPU reads, and it
        computes its experts' share of them, the mean rank's tokens' worth."""
        read: float = context_tokens
        pairs: float = prefill_pairs
        if self.sliding_share:
            read -= self.sliding_share * skipped_context
            pairs -= self.sliding_share * skipped_pairs
        drafts = decode_seqs * self.speculative_tokens
        tokens = decode_seqs + drafts + prefill_tokens
        step_s = (self.fixed_s(tokens, round_tokens) + self.b * decode_seqs
                  + rho * self.c * read + self.d * prefill_tokens + self.e * pairs)
        if round_tokens:  # (b and d charge this rank's tokens the experts' FLOPs)
            step_s += self.expert_flops_s * (round_tokens / self.expert_batch_ranks - tokens)
        if not self.speculates:
            return step_s
        step_s += self._speculation_s(decode_seqs, read, rho)
        drafter = self.drafter
        if drafter is not None and prefill_tokens:  # it reads the new prompts too
            step_s += drafter.d * prefill_tokens + drafter.e * pairs
            if not decode_seqs:  # (else its decode passes read its weights already)
                step_s += drafter.fixed_s(prefill_tokens)
        return step_s

    @property
    def speculates(self) -> bool:
        """Whether steps carry drafts or run a drafter (which passes at K = 0 too)."""
        return bool(self.speculative_tokens) or self.drafter is not None

    def _speculation_s(self, decode_seqs: int, read: float, rho: float) -> float:
        """What drafts add to a step that decodes ``decode_seqs`` sequences reading ``read``
        context tokens: their pass through the target's GEMMs, and the drafter's k passes
        (one where K is 0: as in vLLM, the drafter still reads the step's tokens, to keep
        its KV in step for later drafts)."""
        if not decode_seqs:
            return 0.0
        drafter = self.drafter
        pass_s = 0.0 if drafter is None else (drafter.fixed_s(decode_seqs)
                                              + drafter.b * decode_seqs
                                              + rho * drafter.c * read)
        if not self.speculative_tokens:
            return pass_s
        return self.speculative_tokens * ((self.d + self.draft_state_s) * decode_seqs
                                          + pass_s)

    def share(self, fraction: float, source: str,
              attention_fraction: float | None = None) -> StepTimeModel:
        """A model of ``fraction`` of this one's layers (an EAGLE or MTP drafter): every
        coefficient scaled, none of its own speculation. Its layers are attention layers:
        they read ``attention_fraction`` (default ``fraction``) of the context's KV, and no
        state (a state-space hybrid's drafter)."""
        if attention_fraction is None:
            attention_fraction = fraction
        return replace(self, a=self.a * fraction, b=(self.b - self.state_s) * fraction,
                       c=self.c * attention_fraction, d=self.d * fraction,
                       e=self.e * attention_fraction,
                       expert_s=self.expert_s * fraction,
                       expert_flops_s=self.expert_flops_s * fraction, source=source,
                       sliding_share=0.0, state_s=0.0, draft_state_s=0.0,
                       speculative_tokens=0, drafter=None)

    def decode_step_time(self, decode_seqs: int, rho: float) -> Callable[[int, int], float]:
        """``step_time`` of a pure-decode step as a function of its context tokens and
        those past a sliding window, with bit-identical results (adding the zero prefill
        terms changes no float)."""
        if self.speculates:  # (drafts and drafter: step_time itself)
            return lambda context_tokens, skipped: self.step_time(
                decode_seqs, context_tokens, 0, 0, rho, skipped)
        fixed = self.fixed_s(decode_seqs) + self.b * decode_seqs
        per_context = rho * self.c
        share = self.sliding_share
        if not share:
            return lambda context_tokens, skipped: fixed + per_context * context_tokens
        return lambda context_tokens, skipped: fixed + per_context * (
            context_tokens - share * skipped)


def with_transfer(compute_s: float, transfer_s: float, pipelined_layers: int) -> float:
    """How long a step's computation C and a KV transfer T of its layers take together: one
    after the other (``pipelined_layers`` 0), or layer by layer, each layer's transfer under
    another layer's computation (``pipelined_layers`` = the model's layers L): the first
    layer of one and the last of the other stand alone, so max(C, T) + min(C, T) / L. The
    transfer is KV loaded from host memory before the layer computes, or sent to a decode
    replica after it has."""
    if not pipelined_layers:
        return compute_s + transfer_s
    return max(compute_s, transfer_s) + min(compute_s, transfer_s) / pipelined_layers


def pipeline_hop_s_per_token(model: ModelSpec, gpu: GpuSpec, tensor_parallel_size: int,
                             pipeline_parallel_size: int,
                             link_gbps: float | None = None) -> float:
    """Seconds one token's activations take from one pipeline stage to the next: its
    hidden state and residual (vLLM sends both), each GPU of the stage's tensor-parallel
    group a 1/N slice of them (the next stage gathers them over its own NVLink). Over
    ``link_gbps`` if given, else NVLink where every stage sits on one board, else the
    network (:data:`DEFAULT_PIPELINE_NETWORK_GBPS`)."""
    gpus = tensor_parallel_size * pipeline_parallel_size
    on_board = gpu.interconnect_bytes_per_s is not None and (
        gpu.interconnect_gpus is None or gpus <= gpu.interconnect_gpus)
    link = (link_gbps * 1e9 if link_gbps is not None
            else gpu.interconnect_bytes_per_s if on_board and gpu.interconnect_bytes_per_s
            else DEFAULT_PIPELINE_NETWORK_GBPS * 1e9)
    return 2 * model.hidden_size * model.dtype_bytes / tensor_parallel_size / link


def roofline(model: ModelSpec, gpu: GpuSpec,
             step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S, *,
             tensor_parallel_size: int = 1, data_parallel_size: int = 1,
             expert_parallel: bool = False, expert_load_imbalance: float = 1.0,
             allreduce_latency_s: float = DEFAULT_ALLREDUCE_LATENCY_S) -> StepTimeModel:
    """Coefficients from first principles, for one GPU of a ``tensor_parallel_size`` group
    (all of them work at once, so the slowest, i.e. any, sets the step time).

    a = weights per GPU / HBM bandwidth + a fixed overhead; b = d = 2·params FLOP per token /
    peak FLOP/s per GPU; c = one GPU's KV bytes per token / HBM bandwidth, or its attention's
    FLOPs per context token (QKᵀ and PV, 4·layers·heads·head_dim; under MLA over the latent)
    / peak FLOP/s where more (MLA's many heads over one latent: DeepSeek-V3 on one GPU);
    e = 2·layers·heads·head_dim FLOP per (query, key) pair (QKᵀ and PV, causal) / peak.

    A model's state-space layers cache no KV and have no quadratic part (c, e count its
    attention layers): each step reads and writes every decoding sequence's state in them
    (b; a prefill chunk does so once, which is left out, as are the recurrence's FLOPs, a
    few MFLOP a token against the weights' GFLOPs).

    A mixture-of-experts model multiplies each token by its active parameters only (b, d).
    A step reads the dense weights and the routed experts its tokens choose: with k of E
    experts a token, chosen evenly, T tokens leave (1 − k/E)^T of them unread (see
    :meth:`StepTimeModel.fixed_s`); a batch of 64 on 8 of 128 reads 98 % of them, a single
    token 6 %. Real routers choose less evenly, so fewer are read than that. Without
    ``num_experts`` every step reads every expert. An MLA model reads its latent (c).

    Tensor parallelism divides all of that by N (KV heads as
    :meth:`ModelSpec.kv_bytes_per_token_per_gpu` says) and adds two all-reduces per layer (after
    attention and after the MLP) of hidden × dtype bytes per token. A ring all-reduce sends
    2·(N−1)/N of the message over each GPU's link, which adds to ``b`` and ``d``; its latency
    adds to ``a``.

    ``data_parallel_size`` D ranks of N GPUs each (one step of every rank at once) keep the
    experts on all G = D·N GPUs: each GPU holds 1/G of them and serves every rank's tokens
    (a step's ``round_tokens`` choose its experts, and it computes 1/D of their expert FLOPs,
    ``expert_flops_s`` each; without them, the ranks are taken as equally busy, D times this
    rank's tokens, whose FLOPs per own token are then unchanged). Each MoE layer then sends every
    token's hidden state out and back (dispatch and combine, in place of the MLP's
    all-reduce): to its k experts' GPUs under ``expert_parallel``, else to all D ranks (each
    expert split over every GPU, every rank's tokens gathered), (G−1)/G of them off the GPU,
    the N GPUs of a rank sharing the sending; each adds its latency to ``a``.

    Whole experts on GPUs of their own (``expert_parallel``) get what the router sends them:
    the busiest GPU gets ``expert_load_imbalance`` times the mean GPU's tokens, and every GPU
    waits for it in each MoE layer, so its experts' FLOPs, the tokens it receives and the
    chance that a token chooses one of its experts are that many times the mean.
    """
    tp, dp = tensor_parallel_size, data_parallel_size
    gpus = tp * dp
    spread = model.is_moe and gpus > 1 and (dp > 1 or expert_parallel)
    # The busiest GPU's routed work over the mean's: 1 but for whole experts on each GPU.
    hot = expert_load_imbalance if spread and expert_parallel else 1.0
    per_token_flops = 2.0 * model.flops_params / tp
    expert_flops_s = gpu.flops_s(
        hot * 2.0 * model.routed_expert_params * model.expert_share / tp, model.fp8_share,
        model.fp4_share)
    per_token_link_s = 0.0
    link_fixed_s = 0.0
    if tp > 1 or spread:
        if not gpu.interconnect_bytes_per_s:
            raise ValueError(f"{gpu.name}: no interconnect bandwidth, which tensor parallelism "
                             "and experts spread over GPUs need")
        link = gpu.interconnect_bytes_per_s
        token_bytes = model.hidden_size * model.dtype_bytes
        exchanges = model.moe_layers if spread else 0
        if tp > 1:  # after attention, and after each MLP the experts do not combine
            allreduces = 2 * model.num_layers - exchanges
            per_token_link_s += allreduces * 2.0 * (tp - 1) / tp * token_bytes / link
            link_fixed_s += allreduces * allreduce_latency_s
        if spread:
            copies = (model.experts_per_token or 1) if expert_parallel else dp
            per_token_link_s += (hot * exchanges * 2.0 * copies * (gpus - 1) / gpus / tp
                                 * token_bytes / link)
            link_fixed_s += 2 * exchanges * allreduce_latency_s
    name = gpu.name if tp == 1 else f"{tp} × {gpu.name}"
    if spread:
        name = (f"{dp} ranks of {name}" if dp > 1 else name) + (
            ", expert parallel" if expert_parallel else "")
    heads_per_gpu = model.num_heads / tp
    attention_flops_per_token = (4.0 * model.kv_layers * heads_per_gpu
                                 * (model.kv_latent_dim or model.head_dim))
    # A state-space layer reads and writes each decoding sequence's state every step.
    state_s = 2.0 * state_write_s(model, gpu, tp)
    per_token_s = (gpu.flops_s(per_token_flops, model.fp8_share, model.fp4_share)
                   + per_token_link_s)
    if hot > 1:  # the busiest GPU's experts compute more than their even share
        per_token_s += expert_flops_s * (1 - 1 / hot)
        name += f", expert load {hot:g}× the mean"
    return StepTimeModel(
        a=(model.weight_bytes_per_gpu(tp, gpus) / gpu.hbm_bandwidth_bytes_per_s
           + step_overhead_s + link_fixed_s),
        b=per_token_s + state_s,
        c=max(model.kv_bytes_per_token_per_gpu(tp) / gpu.hbm_bandwidth_bytes_per_s,
              attention_flops_per_token / gpu.peak_flops),
        d=per_token_s,
        e=2.0 * model.kv_layers * model.attention_dim / tp / gpu.peak_flops,
        source=f"roofline({model.name}, {name})",
        expert_s=model.routed_expert_bytes / gpus / gpu.hbm_bandwidth_bytes_per_s,
        expert_share=min(1.0, hot * model.expert_share),
        expert_batch_ranks=dp,
        expert_flops_s=expert_flops_s,
        state_s=state_s,
    )


def state_write_s(model: ModelSpec, gpu: GpuSpec, tensor_parallel_size: int) -> float:
    """Seconds to write (or read) one sequence's state in every state-space layer of
    ``model``, on one GPU of a tensor-parallel group, at the GPU's memory bandwidth (0 for
    a model without state layers)."""
    return (model.num_state_layers * model.state_bytes_per_layer_per_gpu(tensor_parallel_size)
            / gpu.hbm_bandwidth_bytes_per_s)


def _finite(value: object) -> bool:
    """Whether a value read from YAML is a finite number (a flag is none: YAML's yes/no)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(
        value)


def _whole(value: object) -> bool:
    """Whether a value read from YAML is a whole number (a flag is none)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Calibration:
    """A calibration file (YAML) — what ``gpu_validate`` writes and ``timing.calibration`` reads.

    ::

        kvsim_calibration: 1          # format version
        model: llama-2-7b             # the model the timings are for (a scenario must match)
        device: NVIDIA H200           # free text: device, driver, date
        coefficients: {a: 0.0071, b: 4.1e-5, c: 1.9e-7, d: 4.3e-5, e: 1.1e-9}   # seconds
        rho: {8: 1.21, 16: 1.12, 32: 1.07, 64: 1.04, 128: 1.03}               # optional
        fit: {mape: 0.031, max_error: 0.08, held_out_points: 40}              # optional
        tensor_parallel_size: 1       # optional: GPUs the timings span (a scenario must match)
        kv_cache_dtype: auto          # optional: the KV cache's dtype in the timed kernels
    """

    model: str
    device: str
    coefficients: dict[str, float]
    rho: dict[int, float]
    fit: dict[str, float]
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"

    @classmethod
    def load(cls, path: Path) -> Calibration:
        data = read_yaml(path, "a calibration YAML file (kvsim calibrate writes one)",
                         CalibrationError)
        if not isinstance(data, dict) or data.get("kvsim_calibration") != 1:
            raise CalibrationError(f"{path}: not a kvsim calibration (kvsim_calibration: 1)")
        coefficients = data.get("coefficients")
        if not isinstance(coefficients, dict) or set(coefficients) != set("abcde"):
            raise CalibrationError(f"{path}: coefficients: expected a mapping of a, b, c, d, e")
        for key, value in coefficients.items():
            if not _finite(value) or value < 0:
                raise CalibrationError(f"{path}: coefficients.{key}: expected a finite number "
                                       f">= 0, got {value!r}")
        if not isinstance(data.get("model"), str) or not data["model"]:
            raise CalibrationError(f"{path}: model: expected the model preset the timings are "
                                   "for (e.g. llama-2-7b)")
        rho = data.get("rho") or {}
        if not isinstance(rho, dict) or not all(
            _whole(k) and k >= 1 and _finite(v) and v > 0 for k, v in rho.items()
        ):
            raise CalibrationError(f"{path}: rho: expected a mapping block_size (a whole "
                                   "number >= 1) -> factor (a finite number > 0)")
        fit = data.get("fit") or {}
        if not isinstance(fit, dict) or not all(
                isinstance(k, str) and _finite(v) for k, v in fit.items()):
            raise CalibrationError(f"{path}: fit: expected a mapping of figures (mape, "
                                   "max_error, ...) -> numbers")
        tensor_parallel_size = data.get("tensor_parallel_size", 1)
        if not _whole(tensor_parallel_size) or tensor_parallel_size < 1:
            raise CalibrationError(f"{path}: tensor_parallel_size: expected a whole number >= 1 "
                                   f"(the GPUs the timings span), got {tensor_parallel_size!r}")
        kv_cache_dtype = data.get("kv_cache_dtype", "auto")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise CalibrationError(f"{path}: kv_cache_dtype: expected one of "
                                   f"{', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        return cls(
            model=str(data.get("model", "")),
            device=str(data.get("device", "")),
            coefficients={k: float(v) for k, v in coefficients.items()},
            rho={int(k): float(v) for k, v in rho.items()},
            fit=dict(fit),
            tensor_parallel_size=tensor_parallel_size,
            kv_cache_dtype=kv_cache_dtype,
        )

    def dump(self, path: Path) -> None:
        path.write_text(yaml.safe_dump({
            "kvsim_calibration": 1,
            "model": self.model,
            "device": self.device,
            "coefficients": self.coefficients,
            "rho": self.rho,
            "fit": self.fit,
            "tensor_parallel_size": self.tensor_parallel_size,
            "kv_cache_dtype": self.kv_cache_dtype,
        }, sort_keys=False))

    def to_model(self, source: str, step_overhead_s: float = 0.0) -> StepTimeModel:
        """The step-time model; ``step_overhead_s`` is added to ``a``: the timings are GPU
        kernels only, and a serving engine also spends CPU time per step (scheduling, sampling,
        launches), the same term the roofline adds."""
        c = self.coefficients
        return StepTimeModel(a=c["a"] + step_overhead_s, b=c["b"], c=c["c"], d=c["d"],
                             e=c["e"], rho_table=dict(self.rho), source=source)
