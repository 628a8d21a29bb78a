"""A chat conversation rendered to one prompt with the model's chat template.

The whole rendered conversation is what gets tokenized, hashed and cached, so a conversation's
next turn finds the previous turn's blocks in the pool. A tokenizer without a chat template
gets `FALLBACK_TEMPLATE` (vLLM would refuse such a request; we log it once at start-up).
"""

from __future__ import annotations

import inspect
from typing import Any

import structlog
from jinja2 import TemplateError

from conductor.errors import InvalidRequest
from conductor.protocol import ChatCompletionRequest

log = structlog.get_logger(__name__)

FALLBACK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] or '' }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplate:
    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.builtin = not getattr(hf_tokenizer, "chat_template", None)
        self._template = FALLBACK_TEMPLATE if self.builtin else None
        if self.builtin:
            log.warning("chat_template_fallback",
                        detail="the tokenizer has no chat template; using the built-in one")
        # Template variables may not shadow apply_chat_template's own parameters.
        self._reserved = set(inspect.signature(hf_tokenizer.apply_chat_template).parameters)

    def render(self, req: ChatCompletionRequest) -> str:
        """The conversation as prompt text (special tokens included by the template)."""
        conversation = [_message(m) for m in req.messages]
        extra = {k: v for k, v in (req.chat_template_kwargs or {}).items()
                 if k not in self._reserved}
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self._tok.apply_chat_template(
                conversation, tools=tools, chat_template=self._template, tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, **extra)
        except (TemplateError, ValueError, TypeError, LookupError) as e:
            raise InvalidRequest(f"The chat template could not render the messages: {e}",
                                 param="messages") from None
        if not isinstance(text, str):
            raise InvalidRequest("The chat template did not render to text.", param="messages")
        return text


def _message(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    for name in ("name", "tool_calls", "tool_call_id", "reasoning"):
        value = getattr(m, name)
        if value is not None:
            out[name] = value
    return out
