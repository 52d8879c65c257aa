"""vLLM's /tokenize and /detokenize bodies: a prompt's or a chat's token ids as a completion of
the same input would count them (its `usage.prompt_tokens`), and the text of token ids."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from app.messages import Tokenize
from app.openai.protocol import STRICT, ChatMessage, ChatTemplateFields, Text, TokenIds
from app.openai.tools import ToolFields
from app.request import InvalidRequest

# The rule of TokenizeRequest.message, stated in its JSON schema (GET /openapi.json).
_PROMPT_OR_MESSAGES: JsonDict = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]
}


class TokenizeRequest(ToolFields, ChatTemplateFields):
    """A prompt, or a chat's messages (with `tools`) as the model's chat template renders them."""

    model_config = ConfigDict(**STRICT, json_schema_extra=_PROMPT_OR_MESSAGES)
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # A prompt's special tokens (BOS...) as a completion adds them; a chat template places its own
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def message(self) -> Tokenize:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give either a prompt or messages.", param="prompt")
        if self.messages is None:
            return Tokenize(
                prompt=self.prompt,
                add_special_tokens=self.add_special_tokens is not False,
                return_token_strs=self.return_token_strs,
            )
        if self.add_special_tokens:
            raise InvalidRequest(
                "add_special_tokens applies to a prompt: the chat template places its own.",
                param="add_special_tokens",
            )
        return Tokenize(
            messages=[m.as_dict() for m in self.messages],
            tools=self.template_tools(),
            return_token_strs=self.return_token_strs,
            **self.template_fields(),
        )


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: Text | None = None
    tokens: TokenIds
