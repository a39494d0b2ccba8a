"""The tokenizer front of the text layer: prompts and chat messages to token ids.

Used by the offline API (:mod:`kvmesh.llm`) and the gateway (:mod:`gateway.stream`); the other
direction, token ids to text deltas with stop strings, is :mod:`gateway.output_processor`.
Importing this module loads no torch (transformers is imported when a tokenizer is loaded).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.core.errors import InvalidRequestError


def load_tokenizer(model_dir):
    """The Hugging Face tokenizer (and chat template) of a checkpoint directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


class TextFront:
    """Prompt handling shared by :class:`kvmesh.llm.LLM`, :class:`kvmesh.llm.AsyncLLM` and the gateway
    (:class:`gateway.stream.RequestPath`); ``tokenizer`` is set by the owner."""

    tokenizer = None

    def encode_prompt(self, prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        """A string, a list of token ids or ``{"prompt_token_ids": [...]}`` → (text, ids).
        Chat-templated text already holds its special tokens: pass ``add_special_tokens=False``."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            return self.encode_prompt(prompt, add_special_tokens)
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")

    @staticmethod
    def cache_salt_of(prompt) -> str | None:
        """The ``cache_salt`` of a prompt dict (``{"prompt": ..., "cache_salt": "..."}``, as
        vLLM's): the request then shares cached KV blocks only with requests of the same salt.
        None for other prompts. Raises InvalidRequestError when it is not a string."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {type(salt).__name__}")
        return salt

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Chat messages (``[{"role": ..., "content": ...}]``) → prompt text via the model's
        chat template, with the assistant turn opened."""
        if not messages or any(not isinstance(m, dict) or "role" not in m or "content" not in m for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {role, content} objects")
        if self.tokenizer.chat_template is None:
            raise InvalidRequestError("this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Chat messages → prompt token ids (the template text already holds its special tokens)."""
        return self.tokenizer.encode(self.apply_chat_template(messages), add_special_tokens=False)
