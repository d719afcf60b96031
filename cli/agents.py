"""What `ft launch` gives each coding agent: its own provider config pointing at a running `ft serve`.

    served = Served.from_card(url, api_key, GET /v1/models's first card)
    launch = plan_launch("crush", served, workdir, ["run", "hi"])
    launch.argv, launch.env, launch.unset, launch.files   # command, variables to set / remove, files to write

Every config names the served model with its context window and output cap from the server's model card, uses the
tool's documented format, and lives under `workdir` (never the user's own config files): the tool is pointed at it
through its documented variable or flags. Cloud API keys are removed from the tool's environment so that nothing
falls back to a paid API. Formats, per tool (as documented by each project, late 2026):
  claude    Claude Code: ANTHROPIC_BASE_URL (the host, no /v1), ANTHROPIC_AUTH_TOKEN (sent as a Bearer token),
            ANTHROPIC_MODEL and the ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL aliases, CLAUDE_CODE_SUBAGENT_MODEL,
            CLAUDE_CODE_MAX_OUTPUT_TOKENS, CLAUDE_CODE_MAX_CONTEXT_TOKENS; the Anthropic Messages API.
  codex     Codex CLI: `-c` TOML overrides of ~/.codex/config.toml: model, model_provider, model_context_window and
            a [model_providers.ft] table (base_url, env_key, wire_api = "responses": Codex speaks only the
            Responses API, which `ft serve` has).
  opencode  OpenCode: an opencode.json named by OPENCODE_CONFIG; provider "ft" through @ai-sdk/openai-compatible
            (options.baseURL, apiKey; models.<id>.limit.context / .output), enabled_providers = ["ft"].
  crush     Crush: crush.json in the directory CRUSH_GLOBAL_CONFIG names; provider "ft" of type openai-compat,
            models[] with context_window / default_max_tokens / can_reason, models.large / .small.
  pi        pi: models.json in the agent directory PI_CODING_AGENT_DIR names (a separate one, so the user's
            stored cloud credentials are not in reach); provider "ft", api openai-completions; `--provider ft
            --model ID`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

PROVIDER = "ft"
LOCAL_KEY = "ft-local"  # sent when the server has no --api-key (some tools refuse an empty key)
# Cloud credentials any of the tools would fall back to, removed from every launch
CLOUD_KEYS = ("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "GEMINI_API_KEY", "GOOGLE_API_KEY",
              "OPENROUTER_API_KEY", "GROQ_API_KEY", "MISTRAL_API_KEY", "XAI_API_KEY", "CEREBRAS_API_KEY",
              "AZURE_OPENAI_API_KEY", "AI_GATEWAY_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
              "AWS_SESSION_TOKEN", "AWS_BEARER_TOKEN_BEDROCK")
TOOL_KEYS = {
    "claude": ("CLAUDE_CODE_OAUTH_TOKEN", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
               "CLAUDE_CODE_USE_FOUNDRY"),
    "codex": ("CODEX_API_KEY", "CODEX_ACCESS_TOKEN"),
    "opencode": ("OPENCODE_API_KEY",),
    "crush": ("HYPER_API_KEY",),
    "pi": ("ZAI_API_KEY", "KIMI_API_KEY", "MINIMAX_API_KEY", "OPENCODE_API_KEY"),
}
TOOLS = tuple(TOOL_KEYS)


@dataclass(frozen=True)
class Served:
    """What the running server says about itself: base URL (no /v1), model id, context window, output cap, whether
    the chat template reasons (<think>), and the API key the tool must send (None: the server takes any)."""

    url: str
    model: str
    context: int
    max_output: int
    reasoning: bool = False
    api_key: str | None = None

    @classmethod
    def from_card(cls, url: str, api_key: str | None, card: dict) -> Served:
        try:
            return cls(url=url.rstrip("/"), model=str(card["id"]), context=int(card["context_length"]),
                       max_output=int(card["max_output_tokens"]),
                       reasoning=bool((card.get("capabilities") or {}).get("reasoning")), api_key=api_key)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{url}/v1/models does not describe a model as `ft serve` does ({e})") from None

    @property
    def key(self) -> str:
        return self.api_key or LOCAL_KEY

    @property
    def output(self) -> int:
        """The output cap a tool is told: the server's, and never more than the window leaves for a prompt."""
        return max(1, min(self.max_output, self.context // 2))


@dataclass(frozen=True)
class Launch:
    tool: str
    argv: list[str]  # the command, the user's ARGS last
    env: dict[str, str] = field(default_factory=dict)  # set
    unset: tuple[str, ...] = ()  # removed
    files: dict[Path, str] = field(default_factory=dict)  # written before the tool starts

    def as_dict(self) -> dict:
        return {"tool": self.tool, "command": self.argv, "env": self.env, "unset": list(self.unset),
                "files": {str(p): text for p, text in self.files.items()}}


def _json(doc: dict) -> str:
    return json.dumps(doc, indent=2) + "\n"


def _claude(s: Served, workdir: Path, args: list[str]) -> Launch:
    env = {"ANTHROPIC_BASE_URL": s.url, "ANTHROPIC_AUTH_TOKEN": s.key, "ANTHROPIC_MODEL": s.model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": s.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": s.model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": s.model, "CLAUDE_CODE_SUBAGENT_MODEL": s.model,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(s.output), "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(s.context),
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1"}
    return Launch("claude", ["claude", *args], env)


def _codex(s: Served, workdir: Path, args: list[str]) -> Launch:
    table = (f'{{ name = "ft", base_url = {json.dumps(s.url + "/v1")}, wire_api = "responses", '
             f'env_key = "FT_API_KEY" }}')
    overrides = [f"model={json.dumps(s.model)}", f"model_provider={json.dumps(PROVIDER)}",
                 f"model_context_window={s.context}", f"model_providers.{PROVIDER}={table}"]
    argv = ["codex"] + [a for o in overrides for a in ("-c", o)] + args
    return Launch("codex", argv, {"FT_API_KEY": s.key})


def _opencode(s: Served, workdir: Path, args: list[str]) -> Launch:
    path = workdir / "opencode" / "opencode.json"
    doc = {"$schema": "https://opencode.ai/config.json", "model": f"{PROVIDER}/{s.model}",
           "small_model": f"{PROVIDER}/{s.model}", "enabled_providers": [PROVIDER],
           "provider": {PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": "ft",
                                   "options": {"baseURL": s.url + "/v1", "apiKey": s.key},
                                   "models": {s.model: {"name": s.model,
                                                        "limit": {"context": s.context, "output": s.output}}}}}}
    env = {"OPENCODE_CONFIG": str(path), "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    return Launch("opencode", ["opencode", *args], env, files={path: _json(doc)})


def _crush(s: Served, workdir: Path, args: list[str]) -> Launch:
    folder = workdir / "crush"
    model = {"id": s.model, "name": s.model, "context_window": s.context, "default_max_tokens": s.output,
             "can_reason": s.reasoning, "supports_attachments": False, "cost_per_1m_in": 0, "cost_per_1m_out": 0,
             "cost_per_1m_in_cached": 0, "cost_per_1m_out_cached": 0}
    pick = {"model": s.model, "provider": PROVIDER}
    doc = {"$schema": "https://charm.land/crush.json",
           "providers": {PROVIDER: {"name": "ft", "type": "openai-compat", "base_url": s.url + "/v1",
                                    "api_key": s.key, "models": [model]}},
           "models": {"large": pick, "small": pick},
           "options": {"disable_provider_auto_update": True, "disable_metrics": True}}
    env = {"CRUSH_GLOBAL_CONFIG": str(folder), "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1",
           "CRUSH_DISABLE_METRICS": "1"}
    return Launch("crush", ["crush", *args], env, files={folder / "crush.json": _json(doc)})


def _pi(s: Served, workdir: Path, args: list[str]) -> Launch:
    folder = workdir / "pi"
    model = {"id": s.model, "name": s.model, "reasoning": s.reasoning, "input": ["text"],
             "contextWindow": s.context, "maxTokens": s.output,
             "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}
    doc = {"providers": {PROVIDER: {"baseUrl": s.url + "/v1", "api": "openai-completions", "apiKey": s.key,
                                    "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                                    "models": [model]}}}
    argv = ["pi", "--provider", PROVIDER, "--model", s.model, *args]
    return Launch("pi", argv, {"PI_CODING_AGENT_DIR": str(folder)}, files={folder / "models.json": _json(doc)})


_BUILDERS = {"claude": _claude, "codex": _codex, "opencode": _opencode, "crush": _crush, "pi": _pi}


def plan_launch(tool: str, served: Served, workdir: Path, args: list[str] | None = None) -> Launch:
    """The launch of `tool` against `served` (module docstring); its files under `workdir`."""
    if tool not in _BUILDERS:
        raise ValueError(f"unknown tool {tool!r}; ft launch knows {', '.join(TOOLS)}")
    launch = _BUILDERS[tool](served, Path(workdir), list(args or ()))
    return Launch(launch.tool, launch.argv, launch.env, CLOUD_KEYS + TOOL_KEYS[tool], launch.files)


def write_files(launch: Launch) -> None:
    """Write the launch's files: each to a temporary name, then renamed over the old one."""
    for path, text in launch.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def environment(launch: Launch, base: dict[str, str]) -> dict[str, str]:
    """`base` (the caller's environment) without the cloud keys, with the launch's variables."""
    env = {k: v for k, v in base.items() if k not in launch.unset}
    env.update(launch.env)
    return env
