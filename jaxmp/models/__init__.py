"""Models that ship with jaxmp; any Flax NNX model works with the trainer too."""
from jaxmp.models.gpt import GPT, GPTConfig, lm_loss, next_token_loss

__all__ = ["GPT", "GPTConfig", "lm_loss", "next_token_loss"]
