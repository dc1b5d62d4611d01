"""Model and GPU presets, and the arithmetic that turns them into a KV pool.

Think of the GPU as a warehouse: the model's weights are the fixed shelving, and what floor
space is left (times the share the engine may use) is the KV pool, measured in *token slots*
whose size is :func:`ModelSpec.kv_bytes_per_token`. Tensor parallelism rents several
warehouses side by side: each holds 1/N of the shelving and 1/N of every token's KV heads, so
a token slot spans all N of them (see :func:`kv_pool_slots`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace

GIB = 1024**3
MIB = 1024**2
# Block sizes attention kernels take (FlashAttention's: multiples of 16 tokens), to which
# vLLM rounds a block raised to hold a state-space layer's state.
KERNEL_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer, as far as KV memory and step time need it.

    Three kinds of attention cache differently. Multi-head attention keeps K and V for every
    head, grouped-query attention (GQA) for each of ``num_kv_heads`` shared heads, and
    multi-head latent attention (MLA, DeepSeek-V2/V3) one compressed latent of
    ``kv_latent_dim`` elements a layer (its ``kv_lora_rank`` plus ``qk_rope_head_dim``), from
    which every head's K and V are rebuilt. A mixture-of-experts model keeps all its
    ``num_params`` in memory but passes each token through only ``active_params`` of them.
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    max_model_len: int
    dtype_bytes: int = 2
    # Bytes of one cached K or V element when the cache is stored narrower than the weights
    # (vLLM's --kv-cache-dtype fp8: 1; an FP4 cache 0.5625, its scales with it); None: the
    # weights' dtype.
    kv_dtype_bytes: float | None = None
    # The residual stream's width (config.json's hidden_size) where it is not
    # num_heads × head_dim (MLA, many MoE models); None: num_heads × head_dim.
    model_dim: int | None = None
    # MLA: elements of the latent one token caches per layer; None: K and V per KV head.
    kv_latent_dim: int | None = None
    # MoE: parameters one token's forward pass multiplies by; None: all of num_params.
    active_params: float | None = None
    # MoE: routed experts per MoE layer, and how many of them each token is sent to (shared
    # experts are part of the dense weights). None: every step reads every expert.
    num_experts: int | None = None
    experts_per_token: int | None = None
    # MoE: the first layers whose MLP is dense, not experts (DeepSeek's
    # first_k_dense_replace); the rest route their tokens to experts.
    num_dense_layers: int = 0
    # Bytes of one stored weight when the checkpoint is quantized (FP8: 1, 4-bit: 0.5);
    # None: dtype_bytes, the dtype activations and the KV cache keep.
    weight_dtype_bytes: float | None = None
    # MoE: bytes of one routed-expert weight where the experts are stored narrower than the
    # rest (GPT-OSS: MXFP4, 4.25 bits with its scales); None: weight_dtype_bytes.
    expert_weight_dtype_bytes: float | None = None
    # Vocabulary (config.json's vocab_size), where a MoE model's active_params leave out the
    # input embedding, which is looked up, not multiplied (GPT-OSS's model card: the
    # unembedding counts, the embedding does not); None: active_params count every dense
    # parameter.
    vocab_size: int | None = None
    # The share of the multiplied weights whose products run on FP8 tensor cores, where the
    # GPU has them (an FP8 checkpoint's linear layers, W8A8 as vLLM runs them); the rest, and
    # attention, multiply in bf16. 0: every weight in bf16.
    fp8_share: float = 0.0
    # The share that runs on FP4 tensor cores (an NVFP4 checkpoint's linear layers, W4A4,
    # as vLLM runs them on a Blackwell GPU); a GPU without them widens those weights to bf16
    # to multiply them (vLLM's Marlin W4A16 kernels on Hopper). 0: none. GPT-OSS's MXFP4
    # experts are not counted here: vLLM multiplies them by bf16 activations (W4A16).
    fp4_share: float = 0.0
    # Sliding-window attention: ``num_sliding_layers`` of the layers see only the last
    # ``sliding_window`` tokens (Mistral-7B-v0.1: all of them; Gemma-2: every other one;
    # Gemma-3: five in six); the others see every token. 0: every layer sees every token.
    sliding_window: int = 0
    num_sliding_layers: int = 0
    # State-space (linear-attention) layers: ``num_state_layers`` of the layers keep no KV
    # a token but one fixed-size recurrent state a sequence (Mamba-2's SSM and convolution
    # states, Gated DeltaNet's: Qwen3-Next, 36 of 48), ``state_bytes_per_layer`` bytes of
    # it in a layer (in the dtypes vLLM keeps them: the model's, unless its
    # mamba_ssm_cache_dtype says float32), split over a tensor-parallel group by head.
    # 0: every layer is an attention layer. Under speculative decoding with k drafts a step
    # the state grows by k × ``state_bytes_per_draft_per_layer`` (Gated DeltaNet's
    # convolution state keeps the kernel's last inputs and one more for each draft: vLLM's
    # ``conv_kernel_size - 1 + num_spec`` columns).
    num_state_layers: int = 0
    state_bytes_per_layer: int = 0
    state_bytes_per_draft_per_layer: int = 0
    # Mamba-2's chunk (config.json's mamba_chunk_size): its kernel can write a state at the
    # end of each chunk of a prefill, which vLLM's mamba cache mode "all" keeps at every
    # block boundary, in blocks of whole chunks. 0: not given (vLLM's Gated DeltaNet
    # models, Qwen3-Next and Qwen3.5, take only mode "align").
    state_chunk_size: int = 0

    @property
    def kv_layers(self) -> int:
        """Layers that cache K and V (or a latent) for every token: all but the state
        layers."""
        return self.num_layers - self.num_state_layers

    @property
    def full_attention_layers(self) -> int:
        """Layers that attend to every token."""
        return self.kv_layers - self.num_sliding_layers

    def kv_cache_groups(self) -> tuple[int, int, int, int]:
        """How vLLM v1's hybrid KV cache manager divides the layers: (layers a group,
        full-attention groups, sliding-window groups, state groups). Each group keeps its
        own block tables, over one pool of blocks of equal size, so every group has as many
        layers: the fewest of any kind, the last group of another kind padded (Gemma-3's 10
        full and 52 sliding layers make 1 + 6 groups of 10; Qwen3-Next's 12 full and 36
        state layers 1 + 3 groups of 12). A model of one kind is one group of all its
        layers."""
        kinds = (self.full_attention_layers, self.num_sliding_layers, self.num_state_layers)
        size = min(layers for layers in kinds if layers)
        most = max(kinds)
        if most < size * 1.25:
            # vLLM pads the fewer to the most where they are nearly as many: gpt-oss-20b
            # with an EAGLE head's layer, 12 sliding and 13 full, makes 1 + 1 groups of 13.
            size = most
        full, sliding, state = (-(-layers // size) for layers in kinds)
        return size, full, sliding, state

    def with_speculation(self, drafter_layers: int, drafts: int) -> ModelSpec:
        """The layers a speculative engine caches: these, and ``drafter_layers`` attention
        layers of this shape (an MTP or EAGLE head's, which vLLM keeps in the same groups:
        Qwen3-Next with its MTP layer caches 13 attention layers beside 36 state layers),
        each state grown for ``drafts`` drafts a step (see ``state_bytes_per_draft_per_layer``).
        For memory layout only: the weights and FLOPs stay the target's."""
        if not (drafter_layers or (drafts and self.state_bytes_per_draft_per_layer)):
            return self
        return replace(self, num_layers=self.num_layers + drafter_layers,
                       state_bytes_per_layer=(self.state_bytes_per_layer
                                              + drafts * self.state_bytes_per_draft_per_layer),
                       state_bytes_per_draft_per_layer=0)

    @property
    def has_state_layers(self) -> bool:
        """Whether some layers keep a recurrent state per sequence instead of KV per token
        (a hybrid of attention and state-space layers)."""
        return self.num_state_layers > 0

    def state_bytes_per_layer_per_gpu(self, tensor_parallel_size: int) -> int:
        """One sequence's recurrent state in one state layer, on one GPU of a
        tensor-parallel group (its heads split over the group)."""
        return self.state_bytes_per_layer // tensor_parallel_size

    def state_tokens_per_layer(self, tensor_parallel_size: int) -> int:
        """Tokens of one attention layer's KV that take the bytes of one sequence's state in
        one state layer (rounded up): the slots of a block the state fills (Qwen3-Next in
        bf16 on one GPU: 536). 0 for a model without state layers."""
        if not self.has_state_layers:
            return 0
        token_bytes = self.kv_bytes_per_token_per_gpu(tensor_parallel_size) / self.kv_layers
        return math.ceil(self.state_bytes_per_layer_per_gpu(tensor_parallel_size)
                         / token_bytes)

    def state_slots_per_sequence(self, tensor_parallel_size: int) -> int:
        """Token slots (every attention layer's KV of a token) that take the bytes of one
        sequence's state in every state layer, rounded up: what a contiguous extent holds
        for it. 0 for a model without state layers."""
        state_bytes = (self.num_state_layers
                       * self.state_bytes_per_layer_per_gpu(tensor_parallel_size))
        return math.ceil(state_bytes / self.kv_bytes_per_token_per_gpu(tensor_parallel_size))

    def state_block_size(self, tensor_parallel_size: int, cache_all_states: bool = False
                         ) -> int:
        """The least block size, in tokens, at which one block of an attention layer holds
        a sequence's state in a state layer, as vLLM v1 raises a hybrid model's attention
        block size to (``HybridAttentionMambaModelConfig``): a multiple of
        :data:`KERNEL_BLOCK_ALIGNMENT` tokens (Qwen3-Next in bf16 on one GPU: 544); with
        ``cache_all_states`` (mamba cache mode "all"), of whole Mamba-2 chunks, so that a
        state written at a chunk's end lies on a block boundary. 0 for a model without state
        layers."""
        align = KERNEL_BLOCK_ALIGNMENT
        if cache_all_states and self.state_chunk_size:
            align = math.lcm(self.state_chunk_size, KERNEL_BLOCK_ALIGNMENT)
        return align * -(-self.state_tokens_per_layer(tensor_parallel_size) // align)

    @property
    def kv_element_bytes(self) -> float:
        """Bytes of one cached K or V element (an FP4 cache's: a fraction, with its scale)."""
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def uses_mla(self) -> bool:
        """Whether the model caches one latent a layer (MLA) instead of K and V per head."""
        return self.kv_latent_dim is not None

    @property
    def is_moe(self) -> bool:
        """Whether a token passes through only some of the weights (a mixture of experts)."""
        return self.active_params is not None

    @property
    def expert_share(self) -> float:
        """k/E: the share of the routed experts one token goes to; 0 where not given."""
        if not (self.num_experts and self.experts_per_token):
            return 0.0
        return self.experts_per_token / self.num_experts

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every attention layer, every KV head: 2 × layers × kv_heads × head_dim ×
        KV dtype; under MLA the latent alone: layers × latent × KV dtype."""
        return self.kv_bytes_per_token_per_gpu(1)

    @property
    def weight_bytes(self) -> float:
        """All the weights, experts included, as stored (``weight_dtype_bytes``, and
        ``expert_weight_dtype_bytes`` for the routed experts)."""
        dense_bytes = self.weight_dtype_bytes or self.dtype_bytes
        if self.expert_weight_dtype_bytes is None:
            return self.num_params * dense_bytes
        routed = self.routed_expert_params
        return (self.num_params - routed) * dense_bytes + routed * self.expert_bytes

    @property
    def expert_bytes(self) -> float:
        """Bytes of one stored routed-expert weight."""
        return self.expert_weight_dtype_bytes or self.weight_dtype_bytes or self.dtype_bytes

    @property
    def routed_expert_params(self) -> float:
        """Parameters of the routed experts: what the active parameters leave out (less an
        input embedding they do not count) is the unchosen (E − k)/E of them."""
        if not (self.active_params and self.expert_share):
            return 0.0
        embedding = (self.vocab_size or 0) * self.hidden_size
        return (self.num_params - self.active_params - embedding) / (1 - self.expert_share)

    @property
    def routed_expert_bytes(self) -> float:
        """Weights of the routed experts, which a step reads only where its tokens go."""
        return self.routed_expert_params * self.expert_bytes

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP routes each token to experts (0 for a dense model)."""
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    def weight_bytes_per_gpu(self, tensor_parallel_size: int,
                             expert_parallel_gpus: int | None = None) -> float:
        """The weights one GPU holds: 1/N of them over a tensor-parallel group of N, but the
        routed experts split over ``expert_parallel_gpus`` (every GPU of the data-parallel
        ranks, as vLLM spreads a MoE layer's experts; N when None)."""
        expert_gpus = expert_parallel_gpus or tensor_parallel_size
        if expert_gpus == tensor_parallel_size:
            return self.weight_bytes / tensor_parallel_size
        experts = self.routed_expert_bytes
        return (self.weight_bytes - experts) / tensor_parallel_size + experts / expert_gpus

    @property
    def flops_params(self) -> float:
        """Parameters each token is multiplied by: the active ones of a MoE model."""
        return self.active_params or self.num_params

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream, which tensor parallelism all-reduces."""
        return self.model_dim or self.attention_dim

    @property
    def attention_dim(self) -> int:
        """num_heads × head_dim: the width over which each query meets each key."""
        return self.num_heads * self.head_dim

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads each GPU holds under tensor parallelism. With more GPUs than KV heads
        (GQA) every GPU keeps one whole head, replicated, as vLLM does."""
        return max(1, self.num_kv_heads // tensor_parallel_size)

    def kv_elements_per_layer_tensor(self, tensor_parallel_size: int) -> int:
        """Elements one token adds to one layer's K (or V, or MLA latent) tensor on one GPU.
        vLLM keeps the whole MLA latent on every GPU of a tensor-parallel group: every head
        needs all of it, so it cannot be split by head."""
        if self.kv_latent_dim is not None:
            return self.kv_latent_dim
        return self.kv_heads_per_gpu(tensor_parallel_size) * self.head_dim

    @property
    def kv_tensors_per_layer(self) -> int:
        """Cached tensors per layer: K and V, or the MLA latent alone."""
        return 1 if self.uses_mla else 2

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int) -> int:
        """One token's K and V (or MLA latent), every attention layer's, on one GPU of a
        tensor-parallel group (state layers keep none)."""
        # (Whole bytes: an FP4 cache's elements come in blocks of 16, a byte of scale each.)
        return round(self.kv_tensors_per_layer * self.kv_layers
                     * self.kv_elements_per_layer_tensor(tensor_parallel_size)
                     * self.kv_element_bytes)

    def pipeline_stage_layers(self, pipeline_parallel_size: int) -> list[int]:
        """Layers each pipeline stage holds, first to last, as vLLM splits them
        (``get_pp_indices``): evenly, the remainder one each to the stages before the last,
        which also holds the LM head."""
        base, remainder = divmod(self.num_layers, pipeline_parallel_size)
        layers = [base] * pipeline_parallel_size
        for stage in range(2, remainder + 2):
            layers[-stage] += 1
        return layers

    def tokens_per_page(self, page_bytes: int, tensor_parallel_size: int) -> int:
        """Tokens one physical page holds when, as vAttention lays KV out, every layer's K and
        every layer's V (or MLA latent) is a virtual tensor of its own on each GPU: a page
        backs one of them, so it holds ``page_bytes`` / (its elements a token × KV dtype)."""
        return int(page_bytes // (self.kv_elements_per_layer_tensor(tensor_parallel_size)
                                  * self.kv_element_bytes))

    def slots_in_gib(self, gib: float, tensor_parallel_size: int) -> int:
        """Token slots ``gib`` GiB hold when spread over a tensor-parallel group's GPUs."""
        return int(gib * GIB // (self.kv_bytes_per_token_per_gpu(tensor_parallel_size)
                                 * tensor_parallel_size))

    def tensor_parallel_problem(self, tensor_parallel_size: int) -> str | None:
        """Why the model cannot be split over ``tensor_parallel_size`` GPUs, or None.

        vLLM's rule: the query heads divide evenly, and the KV heads either divide evenly or
        are replicated, which needs the GPU count to be a multiple of them. An MLA latent is
        replicated whole on every GPU, whatever their number.
        """
        tp, kv = tensor_parallel_size, self.num_kv_heads
        if self.num_heads % tp:
            return f"{self.name}'s {self.num_heads} attention heads do not divide over {tp} GPUs"
        if self.state_bytes_per_layer % tp:
            return (f"{self.name}'s state of {self.state_bytes_per_layer:,} bytes a layer "
                    f"does not divide over {tp} GPUs")
        if self.state_bytes_per_draft_per_layer % tp:
            return (f"{self.name}'s state's {self.state_bytes_per_draft_per_layer:,} bytes a "
                    f"draft a layer do not divide over {tp} GPUs")
        if self.uses_mla:  # the latent is whole on every GPU
            return None
        if (kv % tp) if kv >= tp else (tp % kv):
            return (f"{self.name}'s {kv} KV heads neither divide over {tp} GPUs nor replicate "
                    f"evenly onto them")
        return None


@dataclass(frozen=True)
class GpuSpec:
    """Memory size, HBM bandwidth, dense bf16/fp16 tensor throughput and GPU-to-GPU link
    bandwidth (one direction, what a ring all-reduce is limited by) of one GPU, how many
    GPUs that link joins (``None``: as many as asked) and what the link is."""

    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    peak_flops: float
    interconnect_bytes_per_s: float | None = None
    interconnect_gpus: int | None = None
    host_link_bytes_per_s: float | None = None  # to CPU memory, one direction (PCIe)
    interconnect_kind: str = "NVLink"
    # Dense FP8 tensor FLOP/s; None: no FP8 tensor cores (an A100 widens an FP8 weight to
    # bf16 to multiply it, as vLLM's Marlin kernels do).
    fp8_peak_flops: float | None = None
    # Dense FP4 tensor FLOP/s (Blackwell's NVFP4); None: no FP4 tensor cores.
    fp4_peak_flops: float | None = None

    def flops_s(self, flops: float, fp8_share: float = 0.0, fp4_share: float = 0.0) -> float:
        """Seconds ``flops`` of matrix products take at peak: ``fp8_share`` of them in FP8
        and ``fp4_share`` in FP4 where this GPU has such tensor cores, the rest in bf16."""
        narrow = [(share, rate) for share, rate in ((fp8_share, self.fp8_peak_flops),
                                                    (fp4_share, self.fp4_peak_flops))
                  if share and rate is not None]
        if not narrow:
            return flops / self.peak_flops
        seconds_per_flop = (1 - sum(share for share, _ in narrow)) / self.peak_flops
        for share, rate in narrow:
            seconds_per_flop += share / rate
        return flops * seconds_per_flop

    @property
    def link_domain(self) -> str:
        """What the GPU link joins: one HGX board (NVLink), or one server (PCIe)."""
        return "board" if self.interconnect_kind == "NVLink" else "server"


def _mean_weight_bytes(params: float, quantized_params: float,
                       quantized_bytes: float = 1.0) -> float:
    """Bytes of a stored weight on average when ``quantized_params`` of ``params`` take
    ``quantized_bytes`` each (FP8: 1; NVFP4: 0.5625, 4 bits and an FP8 scale per 16) and the
    rest two (bf16)."""
    return (2 * params - (2 - quantized_bytes) * quantized_params) / params


# NVFP4: 4-bit values in blocks of 16, each block with an FP8 (E4M3) scale: 4.5 bits a weight.
_NVFP4_BYTES = 4.5 / 8


# FP8 checkpoints. Llama-3.1-70B's, as RedHat's Llama-3.1-70B-Instruct-FP8 and vLLM's
# --quantization fp8 store it: every linear layer in FP8, the input embedding and the LM head
# (128,256 × 8,192 each) in bf16. Llama-3.1-405B's, as Meta quantized it (Llama 3 paper,
# §6.2): the MLPs (3 × 16,384 × 53,248 a layer) of all but its first and last layers.
_LLAMA_70B_LINEAR_PARAMS = 70.55e9 - 2 * 128256 * 8192
_LLAMA_405B_FP8_PARAMS = 124 * 3 * 16384 * 53248
# FP4 checkpoints, as NVIDIA's Model Optimizer makes them (nvidia/Llama-3.3-70B-Instruct-FP4,
# nvidia/Llama-3.1-405B-Instruct-FP4): every linear layer of the transformer blocks in NVFP4,
# weights and activations; the input embedding and the LM head in bf16.
_LLAMA_405B_LINEAR_PARAMS = 405.85e9 - 2 * 128256 * 16384

# Shapes from each model's config.json on its Hugging Face model card.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        ModelSpec("llama-2-7b", 32, 32, 32, 128, 6.74e9, 4096),
        ModelSpec("llama-2-13b", 40, 40, 40, 128, 13.0e9, 4096),
        # Llama-2-70B uses grouped-query attention: 64 query heads share 8 KV heads.
        ModelSpec("llama-2-70b", 80, 64, 8, 128, 68.98e9, 4096),
        ModelSpec("llama-3-8b", 32, 32, 8, 128, 8.03e9, 8192),
        # Llama-3.1-8B: Llama-3-8B's shapes with a 128K context (long traces such as Mooncake).
        ModelSpec("llama-3.1-8b", 32, 32, 8, 128, 8.03e9, 131072),
        # Llama-3.1-70B and -405B: GQA with 8 KV heads, a 128K context. In FP8 the 70B
        # comes to 72.7 GB, 1.03 bytes a weight; Meta's 405B to 487 GB, 1.2 bytes a weight,
        # which one board of eight 80 GB GPUs holds. Their FP8 weights multiply in FP8 (where
        # the GPU can); their KV caches stay 16-bit (fp8 or FP4 is memory.kv_cache_dtype's).
        ModelSpec("llama-3.1-70b", 80, 64, 8, 128, 70.55e9, 131072),
        ModelSpec("llama-3.1-70b-fp8", 80, 64, 8, 128, 70.55e9, 131072,
                  weight_dtype_bytes=_mean_weight_bytes(70.55e9, _LLAMA_70B_LINEAR_PARAMS),
                  fp8_share=_LLAMA_70B_LINEAR_PARAMS / 70.55e9),
        # Llama-3.3-70B: Llama-3.1-70B's shapes; NVIDIA's FP4 checkpoint comes to 42.7 GB.
        ModelSpec("llama-3.3-70b-fp4", 80, 64, 8, 128, 70.55e9, 131072,
                  weight_dtype_bytes=_mean_weight_bytes(70.55e9, _LLAMA_70B_LINEAR_PARAMS,
                                                        _NVFP4_BYTES),
                  fp4_share=_LLAMA_70B_LINEAR_PARAMS / 70.55e9),
        ModelSpec("llama-3.1-405b", 126, 128, 8, 128, 405.85e9, 131072),
        ModelSpec("llama-3.1-405b-fp8", 126, 128, 8, 128, 405.85e9, 131072,
                  weight_dtype_bytes=_mean_weight_bytes(405.85e9, _LLAMA_405B_FP8_PARAMS),
                  fp8_share=_LLAMA_405B_FP8_PARAMS / 405.85e9),
        # In NVFP4: 234 GB, which two B200s hold (or two H200s, multiplying in bf16).
        ModelSpec("llama-3.1-405b-fp4", 126, 128, 8, 128, 405.85e9, 131072,
                  weight_dtype_bytes=_mean_weight_bytes(405.85e9, _LLAMA_405B_LINEAR_PARAMS,
                                                        _NVFP4_BYTES),
                  fp4_share=_LLAMA_405B_LINEAR_PARAMS / 405.85e9),
        # Llama-3.2-1B: Llama-3.1's tokenizer, often the draft model of Llama-3.1-8B or -70B.
        ModelSpec("llama-3.2-1b", 16, 32, 8, 64, 1.24e9, 131072),
        ModelSpec("mistral-7b", 32, 32, 8, 128, 7.24e9, 32768),
        # OPT-13B: 800 KB per token, the figure the vLLM paper (SOSP'23, §3) quotes.
        ModelSpec("opt-13b", 40, 40, 40, 128, 12.85e9, 2048),
        # Qwen3-8B and Qwen3-32B: dense, GQA with 8 KV heads of 128 (32B: 64 query heads
        # over a 5,120-wide residual stream), a 40,960-token context.
        ModelSpec("qwen3-8b", 36, 32, 8, 128, 8.19e9, 40960),
        ModelSpec("qwen3-32b", 64, 64, 8, 128, 32.76e9, 40960, model_dim=5120),
        # Qwen3-30B-A3B: a mixture of experts (8 of 128 a token), GQA with 4 KV heads.
        ModelSpec("qwen3-30b-a3b", 48, 32, 4, 128, 30.5e9, 40960, model_dim=2048,
                  active_params=3.3e9, num_experts=128, experts_per_token=8),
        # Qwen3-235B-A22B: 8 of 128 experts a token in every one of 94 layers, 4 KV heads.
        ModelSpec("qwen3-235b-a22b", 94, 64, 4, 128, 235.09e9, 40960, model_dim=4096,
                  active_params=22.19e9, num_experts=128, experts_per_token=8),
        # DeepSeek-V2-Lite and DeepSeek-V3: MLA, a latent of kv_lora_rank 512 +
        # qk_rope_head_dim 64 a layer; head_dim is a query head's (128 + 64). Parameter counts
        # (total, activated) from their papers; routed experts 6 of 64 (V2-Lite) and 8 of 256
        # (V3) a token, after 1 and 3 dense layers; V3 ships its weights in FP8.
        ModelSpec("deepseek-v2-lite", 27, 16, 16, 192, 15.7e9, 163840, model_dim=2048,
                  kv_latent_dim=576, active_params=2.4e9, num_experts=64, experts_per_token=6,
                  num_dense_layers=1),
        ModelSpec("deepseek-v3", 61, 128, 128, 192, 671e9, 163840, model_dim=7168,
                  kv_latent_dim=576, active_params=37e9, num_experts=256, experts_per_token=8,
                  weight_dtype_bytes=1, fp8_share=1.0, num_dense_layers=3),
        # Sliding-window attention. Mistral-7B-v0.1: a 4,096-token window in every layer
        # (later versions dropped it: the mistral-7b preset). Gemma-2-9B: a 4,096-token
        # window in every other layer (21 of 42). Gemma-3-27B: a 1,024-token window in five
        # layers of six (52 of 62); its parameters include the vision encoder vLLM loads.
        ModelSpec("mistral-7b-v0.1", 32, 32, 8, 128, 7.24e9, 32768, sliding_window=4096,
                  num_sliding_layers=32),
        ModelSpec("gemma-2-9b", 42, 16, 8, 256, 9.24e9, 8192, model_dim=3584,
                  sliding_window=4096, num_sliding_layers=21),
        ModelSpec("gemma-3-27b", 62, 32, 16, 128, 27.4e9, 131072, model_dim=5376,
                  sliding_window=1024, num_sliding_layers=52),
        # GPT-OSS: a 128-token window in every other layer, 4 of 32 (20b) or 128 (120b)
        # experts a token, the experts in MXFP4 and the rest in bf16. Parameters from
        # OpenAI's model card (total, active; the active ones count the unembedding, not
        # the embedding): the checkpoints come to its 12.8 and 60.8 GiB.
        ModelSpec("gpt-oss-20b", 24, 64, 8, 64, 20.91e9, 131072, model_dim=2880,
                  active_params=3.61e9, num_experts=32, experts_per_token=4,
                  expert_weight_dtype_bytes=4.25 / 8, vocab_size=201088,
                  sliding_window=128, num_sliding_layers=12),
        ModelSpec("gpt-oss-120b", 36, 64, 8, 64, 116.83e9, 131072, model_dim=2880,
                  active_params=5.13e9, num_experts=128, experts_per_token=4,
                  expert_weight_dtype_bytes=4.25 / 8, vocab_size=201088,
                  sliding_window=128, num_sliding_layers=18),
        # Attention and state-space layers. Qwen3-Next-80B-A3B: full attention (2 KV heads
        # of 256) in every fourth layer, 12 of 48; the other 36 are Gated DeltaNet layers,
        # each keeping a sequence's convolution state (3 × 8,192: the kernel's last 3
        # inputs of 16 key heads twice and 32 value heads, 128 wide) and its recurrent state
        # (32 value heads × 128 × 128); 10 of 512 experts a token. vLLM raises its block
        # size to 544 tokens on one GPU (272 on four) to hold that state in a block. Each
        # speculative draft widens the convolution state by one input (8,192 elements).
        ModelSpec("qwen3-next-80b-a3b", 48, 16, 2, 256, 80e9, 262144, model_dim=2048,
                  active_params=3e9, num_experts=512, experts_per_token=10,
                  num_state_layers=36, state_bytes_per_layer=(3 * 8192 + 32 * 128 * 128) * 2,
                  state_bytes_per_draft_per_layer=8192 * 2),
        # Qwen3.5 (config.json): the same pattern, full attention in every fourth layer,
        # its Gated DeltaNet's recurrent state kept in float32 (mamba_ssm_dtype) beside a
        # bf16 convolution state. 35B-A3B: 10 of 40 layers attend (2 KV heads of 256);
        # 16 key and 32 value heads of 128; 8 of 256 experts a token. vLLM raises its
        # block to 1,056 tokens on one or two GPUs (its logs: "Padding mamba page size by
        # 0.76%"). 27B, dense: 16 of 64 attend (4 KV heads of 256); 16 key and 48 value
        # heads; blocks of 784 tokens (padding 0.13%).
        ModelSpec("qwen3.5-35b-a3b", 40, 16, 2, 256, 35e9, 262144, model_dim=2048,
                  active_params=3e9, num_experts=256, experts_per_token=8,
                  num_state_layers=30,
                  state_bytes_per_layer=3 * 8192 * 2 + 32 * 128 * 128 * 4,
                  state_bytes_per_draft_per_layer=8192 * 2),
        ModelSpec("qwen3.5-27b", 64, 24, 4, 256, 27e9, 262144, model_dim=5120,
                  num_state_layers=48,
                  state_bytes_per_layer=3 * 10240 * 2 + 48 * 128 * 128 * 4,
                  state_bytes_per_draft_per_layer=10240 * 2),
        # Mamba-2 beside attention. IBM's Granite-4.0-H-Tiny (config.json): 4 of 40 layers
        # attend (12 heads, 4 KV heads of 128, no positional encoding), 36 are Mamba-2
        # layers of 48 heads of 64 (d_state 128, one group, a convolution of 4), each
        # keeping a convolution state (3 × (3,072 + 2 × 128)) and an SSM state (48 × 64 ×
        # 128) in bf16; 6 of 64 experts a token beside a shared one. Parameters counted from
        # its shapes (the model card's 7B and 1B active; the active count the tied
        # unembedding). vLLM raises its block to 400 tokens (512 under mamba cache mode
        # "all", whole chunks of 256).
        ModelSpec("granite-4.0-h-tiny", 40, 12, 4, 128, 6.939e9, 131072, model_dim=1536,
                  active_params=1.465e9, num_experts=64, experts_per_token=6,
                  vocab_size=100352, num_state_layers=36,
                  state_bytes_per_layer=(3 * (3072 + 2 * 128) + 48 * 64 * 128) * 2,
                  state_chunk_size=256),
    ]
}

# Memory as the driver reports it (nvidia-smi), bandwidth and dense (non-sparse) bf16, FP8
# and FP4 tensor FLOP/s (the A100 has no FP8 tensor cores; only the B200 has FP4 ones) from
# NVIDIA's datasheets: A100
# datasheet (2021, SXM), H100 datasheet (SXM5, 2023), H200 product brief (SXM, 2024), HGX
# B200 (2025), H20 (HGX, 2024), L40S datasheet (2023).
# NVLink: the datasheets' 600 GB/s (A100), 900 GB/s (H100, H200, H20) and 1.8 TB/s (B200)
# count both directions; one direction is half. It joins the 8 GPUs of one HGX board;
# tensor parallelism beyond a board would run over the (far slower) network. The L40S has
# no NVLink: its GPUs reach each other, as they reach host memory, over PCIe Gen4 x16, in a
# server of 8. PCIe to host memory: the datasheets' 64 GB/s (Gen4 x16: A100, L40S) and
# 128 GB/s (Gen5 x16: H100, H200, H20, B200) count both directions too. The H20 has more
# memory and bandwidth than the H100 (96 GB, 4 TB/s) and a seventh of its tensor throughput:
# a small decode batch, which reads weights and KV, runs as fast; a large one (past ~37
# FLOP a byte read) and prefill, which multiply, far slower.
GPU_PRESETS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("a100-40g", 40960 * MIB, 1555e9, 312e12, 300e9, 8, 32e9),
        GpuSpec("a100-80g", 81920 * MIB, 2039e9, 312e12, 300e9, 8, 32e9),
        GpuSpec("h100-80g", 81559 * MIB, 3.35e12, 989e12, 450e9, 8, 64e9,
                fp8_peak_flops=1979e12),
        GpuSpec("h200-141g", 143771 * MIB, 4.8e12, 989e12, 450e9, 8, 64e9,
                fp8_peak_flops=1979e12),
        GpuSpec("b200-180g", 183359 * MIB, 8.0e12, 2250e12, 900e9, 8, 64e9,
                fp8_peak_flops=4500e12, fp4_peak_flops=9000e12),
        GpuSpec("h20-96g", 97871 * MIB, 4.0e12, 148e12, 450e9, 8, 64e9,
                fp8_peak_flops=296e12),
        GpuSpec("l40s-48g", 46068 * MIB, 864e9, 362e12, 32e9, 8, 32e9,
                interconnect_kind="PCIe", fp8_peak_flops=733e12),
    ]
}


# An FP4 KV cache (SGLang's --kv-cache-dtype fp4_e2m1, TensorRT-LLM's NVFP4 KV cache): E2M1
# values in blocks of 16 elements, each block with an 8-bit scale, 4.5 bits an element.
FP4_KV_BLOCK = 16
FP4_KV_CACHE_DTYPES = ("fp4_e2m1", "nvfp4")
# --kv-cache-dtype values that store the cache narrower than a 16-bit model (vLLM's fp8
# names, and FP4): bytes per element. "auto" (absent here) keeps the model's dtype.
KV_CACHE_DTYPE_BYTES: dict[str, float] = {
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
    **dict.fromkeys(FP4_KV_CACHE_DTYPES, 0.5 + 1 / FP4_KV_BLOCK),
}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)


class SizingError(ValueError):
    """A pool that cannot hold what it must hold."""


def kv_pool_slots(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    kv_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> int:
    """Token slots in one engine's KV pool: an explicit KV size (all the engine's GPUs
    together), or, per GPU, GPU memory × utilization − its share of the weights.

    Under tensor parallelism every GPU holds every token, each with its own KV heads, so the
    slot count is one GPU's pool over one GPU's bytes per token. Under data parallelism (a
    mixture of experts) the pool is one rank's, whose GPUs hold the dense weights as its
    tensor-parallel group splits them and their share of the experts spread over every rank.
    Pipeline stages each hold their layers' weights and KV: a token takes a slot on every
    stage, so the stage of the most layers, whose GPUs have the least room for the most
    bytes a token, sets the count (vLLM sizes the cache by its most constrained worker).
    """
    problem = model.tensor_parallel_problem(tensor_parallel_size)
    if problem:
        raise SizingError(problem)
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise SizingError(f"kv_memory_gib must be > 0, got {kv_memory_gib}")
        return model.slots_in_gib(kv_memory_gib, tensor_parallel_size)
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    gpus = tensor_parallel_size * data_parallel_size
    # The share of the layers (and of their weights: the embeddings are few) the heaviest
    # pipeline stage holds.
    stage_share = max(model.pipeline_stage_layers(pipeline_parallel_size)) / model.num_layers
    weight_bytes_per_gpu = model.weight_bytes_per_gpu(tensor_parallel_size, gpus) * stage_share
    usable_bytes = gpu.memory_bytes * gpu_memory_utilization
    pool_bytes = usable_bytes - weight_bytes_per_gpu
    if pool_bytes <= 0:
        if data_parallel_size > 1:
            share = f" (1/{tensor_parallel_size} of the dense ones, 1/{gpus} of the experts)"
            hint = _ranks_hint(model, gpu, usable_bytes, tensor_parallel_size)
        elif pipeline_parallel_size > 1:
            share = f" (a {pipeline_parallel_size}-stage pipeline's heaviest stage's"
            share += ")" if gpus == 1 else f", 1/{tensor_parallel_size} of them)"
            hint = "; use more pipeline stages or a larger tensor_parallel_size"
        else:
            share = "" if gpus == 1 else f" (1/{tensor_parallel_size} of them)"
            hint = _sharding_hint(model, gpu, usable_bytes)
        raise SizingError(
            f"{model.name} weights{share} ({weight_bytes_per_gpu / GIB:.1f} GiB) do not fit in "
            f"{gpu_memory_utilization:.0%} of {gpu.name} ({usable_bytes / GIB:.1f} GiB): no KV "
            f"pool left{hint}"
        )
    return int(pool_bytes // (model.kv_bytes_per_token_per_gpu(tensor_parallel_size)
                              * stage_share))


def max_concurrency(model: ModelSpec, slots: int, context: int,
                    tensor_parallel_size: int, cache_all_states: bool = False) -> float:
    """Requests of ``context`` tokens a pool of ``slots`` token slots holds at once, as vLLM
    reports its "maximum concurrency": a state-space hybrid's each take, in blocks raised to
    hold a state (whole Mamba-2 chunks under ``cache_all_states``), one block a state group
    and the context's blocks in every full-attention group."""
    if not model.has_state_layers:
        return slots / context
    layers, full, _, state = model.kv_cache_groups()
    block_size = model.state_block_size(tensor_parallel_size, cache_all_states)
    blocks = slots * model.kv_layers // (layers * block_size)
    return blocks / (full * -(-context // block_size) + state)


def _sharding_hint(model: ModelSpec, gpu: GpuSpec, usable_bytes: float) -> str:
    """What to do about weights one GPU cannot hold: the fewest GPUs that hold them and
    split the model evenly, within the GPUs one board (or server) joins."""
    board, domain = gpu.interconnect_gpus or 64, gpu.link_domain
    needed = math.ceil(model.weight_bytes / usable_bytes)
    fitting = [n for n in range(needed, board + 1) if model.tensor_parallel_problem(n) is None]
    if fitting:
        return (f"; shard them over {fitting[0]} GPUs (parallel.tensor_parallel_size: "
                f"{fitting[0]}) or give memory.kv_memory_gib")
    # The fewest stages whose largest (ceil(layers / stages) layers, as vLLM splits them)
    # fits. The largest stage only shrinks as stages are added, so a bisection finds it: a
    # model may have millions of layers.
    def stage_fits(stages: int) -> bool:
        return (model.weight_bytes / board * -(-model.num_layers // stages)
                / model.num_layers < usable_bytes)

    counts = range(2, model.num_layers + 1)
    first = bisect.bisect_left(counts, True, key=stage_fits)
    stages = counts[first] if first < len(counts) else None
    if stages is not None and model.tensor_parallel_problem(board) is None:
        return (f"; no tensor-parallel group of at most {board} {gpu.name} GPUs (one "
                f"{domain}) holds them: split the layers over {domain}s as {stages} "
                f"pipeline stages (parallel: {{tensor_parallel_size: {board}, "
                f"pipeline_parallel_size: {stages}}}), choose a GPU with more memory, or "
                "give memory.kv_memory_gib")
    return (f"; no tensor-parallel group of at most {board} {gpu.name} GPUs (one {domain}) "
            "holds them: choose a GPU with more memory, or give memory.kv_memory_gib")


def _ranks_hint(model: ModelSpec, gpu: GpuSpec, usable_bytes: float,
               tensor_parallel_size: int) -> str:
    """What to do about data-parallel ranks whose weights do not fit: the fewest ranks
    whose GPUs hold the dense weights and their share of the experts, within one board."""
    tp = tensor_parallel_size
    board = gpu.interconnect_gpus or 64
    fitting = [d for d in range(2, board // tp + 1)
               if model.weight_bytes_per_gpu(tp, tp * d) < usable_bytes]
    if fitting:
        return (f"; spread the experts over {fitting[0]} ranks (parallel.data_parallel_size: "
                f"{fitting[0]}) or give memory.kv_memory_gib")
    ranks = board // tp
    return (f"; no {board} GPUs of one {gpu.link_domain} hold the dense weights and "
            f"1/{ranks * tp} of the experts: raise tensor_parallel_size, or choose a GPU with "
            "more memory")


def lookup_model(name: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a KeyError listing the known ones."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODEL_PRESETS)}") from None


def lookup_gpu(name: str) -> GpuSpec:
    """A preset by name (case-insensitive), or a KeyError listing the known ones."""
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        raise KeyError(f"unknown gpu {name!r}; known: {', '.join(GPU_PRESETS)}") from None
