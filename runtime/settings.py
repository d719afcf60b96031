"""The engine's settings: one frozen dataclass, validated once, from which `ft serve` and `ft generate` build flags.

    settings = EngineSettings(device="cuda", vram_budget="8GiB", max_running_requests=8)
    engine = Engine(ftw_dir, settings)

Every field carries its command-line flag and help text (`metadata`); `ft.cli.engine_flags` turns the fields into typer
options, so a setting is declared once, here. Construction checks every value and raises one ValueError naming every
flag that is off; after that nothing downstream re-validates. Normalisation also happens here: `vram_budget` and
`pinned_memory` may be given as text ("8GiB", "12e9") and are stored in bytes; `device` "auto" becomes "cuda" when
torch sees a GPU, else "cpu".
Fields marked "CUDA only" are ignored on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ft.formats.layout import is_safe_name

DENSE_WEIGHTS = ("dequantized", "quantized")  # how quantized dense linears sit on the GPU (OffloadConfig.dense)


def _opt(default, flag: str, help: str, **extra):  # noqa: A002 - the typer keyword
    return field(default=default, metadata={"flag": flag, "help": help, **extra})


@dataclass(frozen=True)
class EngineSettings:
    device: str = _opt("cpu", "--device", "auto (cuda if available, else cpu), cpu, or cuda[:N].", cli_default="auto")
    kv_reserve_tokens: int | None = _opt(None, "--kv-reserve-tokens",
                                         "KV budget in tokens shared by all running requests (and kept prefixes). "
                                         "Default: on CUDA sized from the VRAM budget (a 64k-token context where at "
                                         "most 55 % of what the dense weights leave holds it, the rest goes to the "
                                         "expert cache; the start-up log states the split), on the CPU 8192.",
                                         cli_type=int)
    max_prefill_length: int | None = _opt(None, "--max-prefill-length",
                                          "Prompt tokens per prefill chunk; chunks interleave with decoding. Default: "
                                          "4096 at a VRAM budget (a prefill forward streams every expert without a "
                                          "slot once, so longer chunks move fewer bytes per token), else 2048.",
                                          cli_type=int)
    max_running_requests: int = _opt(4, "--max-running-requests", "Requests decoded together in one batch.")
    max_output_tokens: int = _opt(32768, "--max-output-tokens",
                                  "Per-request output cap; larger max_tokens values are clamped to it.")
    max_queued_requests: int = _opt(64, "--max-queued-requests",
                                    "Waiting requests beyond which new ones are refused (OpenAI 429, Anthropic 529 "
                                    "overloaded_error).")
    kv_block_tokens: int = _opt(256, "--kv-block-tokens", "Step in which a request's KV reservation grows.")
    prefix_cache_entries: int = _opt(8, "--prefix-cache-entries",
                                     "Finished requests whose state is kept, so that a later prompt starting with "
                                     "the same tokens prefills only the rest (agents resend the conversation every "
                                     "turn); kept states give way to running requests. 0 = off.")
    prefix_cache_host_memory: int | str | None = _opt(None, "--prefix-cache-host-memory",
                                                      "Host memory for kept states that the KV budget pushed out "
                                                      "(their rows copied there; a later prompt that starts with "
                                                      "their tokens gets them copied back instead of prefilled), "
                                                      "e.g. 4GiB; 0 = none, evicted states are dropped. Default: on "
                                                      "CUDA an eighth of the memory available at start, at most "
                                                      "16GiB; on the CPU 0 (its KV budget is host memory already).",
                                                      cli_type=str)
    prefix_cache_dir: str | None = _opt(None, "--prefix-cache-dir",
                                        "Keep the prefix cache's states here across restarts: written while the "
                                        "server is idle and at shutdown (a killed server loses at most what changed "
                                        "since it was last idle), loaded at start (this model's only), so agents' "
                                        "conversations resume without prefilling them again.", cli_type=str)
    memory_ratio: float = _opt(0.9, "--memory-ratio",
                               "CUDA only: share of free GPU memory for weights + expert cache + KV when "
                               "--vram-budget is not given, in (0, 1].")
    vram_budget: int | str | None = _opt(None, "--vram-budget",
                                         "CUDA only: the device memory the process may use, as nvidia-smi shows "
                                         "it: what the device holds at start (CUDA context) + dense weights, KV, "
                                         "expert cache; e.g. 8GiB or 12e9; overrides --memory-ratio.", cli_type=str)
    pinned_memory: int | str | None = _opt(None, "--pinned-memory",
                                           "CUDA only: host memory the expert banks may page-lock (it cannot be "
                                           "swapped out), e.g. 8GiB; the CPU computes every cache miss of the rest "
                                           "at decode (prefill reads it through pinned staging buffers); 0 = none. "
                                           "Default: half of the memory available at start.", cli_type=str)
    cpu_lane: bool = _opt(True, "--cpu-lane/--no-cpu-lane",
                          "CUDA only: at a VRAM budget the CPU computes a share of each decode step's expert-cache "
                          "misses while the GPU copies the rest, split by their measured rates; --no-cpu-lane: the "
                          "GPU copies every miss (slower on most hosts), and greedy output equals a resident "
                          "model's bit for bit (the CPU sums in another order).")
    dense_weights: str = _opt("auto", "--dense-weights",
                              "CUDA only: quantized dense linears (FP8 / NVFP4 in ModelOpt checkpoints) dequantized "
                              "to bf16 at load, or kept as stored (decode reads them through a dequantizing GEMV, "
                              "prefill dequantizes them per call): 2-4x less VRAM for them, left to the expert "
                              "cache. auto: kept quantized when decode batches fit the dequantizing GEMV "
                              "(--max-running-requests 8 or fewer) or the budget cannot hold every expert with them "
                              "dequantized, else dequantized.")
    plan: str | None = _opt(None, "--plan",
                            "CUDA only: the FTW's placement plan to start from (`ft plan` writes them: VRAM split, "
                            "experts preloaded into the cache, KV size), by NAME, or none. Default: the plan made "
                            "for this machine (GPU, VRAM budget, host RAM), else one planned at start and not "
                            "written; the start-up log names it.", cli_type=str)
    save_routing: str | None = _opt(None, "--save-routing",
                                    "CUDA only: at shutdown, write the expert cache's routing counts per MoE layer to "
                                    "this JSON file (routing seen by offloaded layers), for `ft plan --routing "
                                    "FILE`.", cli_type=str)
    cuda_graphs: bool = _opt(True, "--cuda-graphs/--enforce-eager",
                             "CUDA only: replay one-token decode steps from CUDA graphs captured at start (when every "
                             "MoE layer is sync-free: modes resident and mapped), or never (--enforce-eager).")

    def __post_init__(self) -> None:
        problems = []
        for name in ("kv_reserve_tokens", "max_prefill_length", "max_running_requests", "max_output_tokens",
                     "max_queued_requests", "kv_block_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.prefix_cache_entries < 0:
            problems.append(f"--prefix-cache-entries must be >= 0, got {self.prefix_cache_entries}")
        if not 0 < self.memory_ratio <= 1:
            problems.append(f"--memory-ratio must be in (0, 1], got {self.memory_ratio}")
        if self.dense_weights not in ("auto", *DENSE_WEIGHTS):
            problems.append(f"--dense-weights {self.dense_weights!r}; use auto, {' or '.join(DENSE_WEIGHTS)}")
        for name, zero_ok in (("vram_budget", False), ("pinned_memory", True), ("prefix_cache_host_memory", True)):
            value = getattr(self, name)
            if value is None:
                continue
            from ft.runtime.gpu.sizing import parse_bytes

            try:
                value = 0 if zero_ok and str(value).strip() == "0" else parse_bytes(value)
                object.__setattr__(self, name, value)
            except ValueError as e:
                problems.append(f"{flag(name)}: {e}")
        if self.plan is not None and self.plan != "none" and not is_safe_name(f"{self.plan}.json"):
            problems.append(f"--plan {self.plan!r}: a plan name is a plain file name (see `ft inspect`), or none")
        try:
            object.__setattr__(self, "device", _resolve_device(self.device))
        except ValueError as e:
            problems.append(str(e))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def flag(name: str) -> str:
    """The command-line flag of field `name` (its first spelling)."""
    return next(f.metadata["flag"] for f in fields(EngineSettings) if f.name == name).split("/")[0]


def _resolve_device(device: str) -> str:
    if device != "auto" and device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device {device!r}; use auto, cpu or cuda[:N]")
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU on this machine")
    return device
