"""Where a dataset row's prompt comes from: a text or token-id column, or chat messages; and,
for a vision-language model, an image column beside the text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.checks import check, check_flag, check_type
from batchgen.prompts import TextPrompt, TokensPrompt

if TYPE_CHECKING:
    from batchgen.llm import LLM


@dataclass(frozen=True)
class PromptSpec:
    """A text or token-id column, or a chat messages column rendered through the chat
    template (shared by the local runner and the Ray processor)."""

    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    chat_template: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    image_column: str | None = None  # a row's image: a path, bytes, {"bytes", "path"}, PIL

    def __post_init__(self) -> None:
        """ValueErrors naming the argument (the messages column overrides the prompt column)."""
        if self.messages_column is None:
            check(_is_name(self.prompt_column), "prompt_column",
                  "a column name (a non-empty string)", self.prompt_column)
        else:
            check(_is_name(self.messages_column), "messages_column",
                  "None or a column name (a non-empty string)", self.messages_column)
        check(self.chat_template is None or isinstance(self.chat_template, str),
              "chat_template", "None or a Jinja template string", self.chat_template)
        check_flag(self.add_generation_prompt, "add_generation_prompt")
        if self.chat_template_kwargs is not None:
            check_type(self.chat_template_kwargs, "chat_template_kwargs", dict,
                       "None or a dict of template variables")
        if self.image_column is not None:
            check(_is_name(self.image_column), "image_column",
                  "None or a column name (a non-empty string)", self.image_column)
            check(self.messages_column is None, "image_column",
                  "used with a text prompt_column (chat messages carry their own image "
                  "parts)", self.image_column)

    @property
    def column(self) -> str:
        return self.messages_column or self.prompt_column  # type: ignore[return-value]

    def prompt(self, llm: LLM, row_id: int, row: dict[str, Any], tokenizer_of: Any = None
               ) -> Any:
        """The row's prompt: its text, its token ids, or its messages through the template
        (`tokenizer_of`: its adapter's tokenizer's, else the LLM's); with an image column, its
        text with the row's image (a row without one: text only)."""
        prompt = self._text_prompt(llm, row_id, row, tokenizer_of)
        image = row.get(self.image_column) if self.image_column is not None else None
        if image is None:
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(f"row {row_id}: image_column needs prompt_column "
                             f"{self.column!r} to hold text (its image placeholder), not token ids")
        return TextPrompt(prompt=prompt, multi_modal_data={"image": image})

    def _text_prompt(self, llm: LLM, row_id: int, row: dict[str, Any], tokenizer_of: Any
                     ) -> Any:
        value = row.get(self.column)
        if self.messages_column is not None:
            return llm.requests.render_chat([value], self.chat_template,
                                            self.add_generation_prompt, False, None,
                                            self.chat_template_kwargs, tokenizer_of)[0]
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple)) and value and all(isinstance(t, int) for t in value):
            return TokensPrompt(prompt_token_ids=list(value))
        raise ValueError(f"row {row_id}: prompt_column {self.column!r} must hold a string or a "
                         f"list of token ids, got {type(value).__name__}")


def _is_name(column: object) -> bool:
    return isinstance(column, str) and bool(column)
