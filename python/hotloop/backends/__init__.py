"""Model backends: the simulator, Cerebras Cloud and OpenAI-compatible chat-completions servers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hotloop.backends.base import Backend
    from hotloop.backends.cerebras import CerebrasBackend
    from hotloop.backends.openai_compat import OpenAICompatBackend
    from hotloop.config import Config

BACKENDS = ("simulator", "cerebras", "openai-compat")


def create(config: "Config") -> "Backend":
    """The backend named by ``config.backend`` (imported lazily)."""
    if config.backend == "simulator":
        from hotloop.backends.simulator import Script, SimulatorBackend

        script = Script.load(config.sim_script) if config.sim_script else None
        sim = SimulatorBackend(
            rate=config.sim_rate,
            ttft=config.sim_ttft,
            output_tokens=config.sim_output_tokens,
            seed=config.sim_seed,
            script=script,
        )
        if config.model:
            sim.default_model = config.model
            if config.model not in sim.models:
                sim.models = (config.model, *sim.models)
        return sim
    chat: CerebrasBackend | OpenAICompatBackend
    if config.backend == "cerebras":
        from hotloop.backends.cerebras import CerebrasBackend

        chat = CerebrasBackend(config)
    elif config.backend == "openai-compat":
        from hotloop.backends.openai_compat import OpenAICompatBackend

        chat = OpenAICompatBackend(config)
    else:
        raise ValueError(f"unknown backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
    why = chat.missing()
    if why is not None:  # said before the server starts, in one line (its start() says it too)
        raise ValueError(why)
    return chat
