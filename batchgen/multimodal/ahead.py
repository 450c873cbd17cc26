"""Image prompts processed ahead of the scheduler: image decoding and the model's HF processor
run in a bounded pool of worker threads, so a call's image prompts are processed side by side
and a stream's next chunk is processed while the engine runs the current one (PIL, numpy,
torch and the Rust tokenizers release the GIL). Each worker has its own copy of the processor:
a fast tokenizer shared across threads can fail ("Already borrowed")."""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from batchgen.multimodal.items import MMPrompt
from batchgen.multimodal.prompt import ImagePrompts, NoImages

Processed = tuple[str, list[int], MMPrompt]

# at most 4 workers, and one core left to the engine's own thread
PROCESSOR_THREADS = max(1, min(4, (os.cpu_count() or 2) - 1))


class ProcessorPool:
    """Runs `ImagePrompts.process` in `threads` workers, each on its own copy; submissions
    come back as futures, in the caller's order."""

    def __init__(self, prompts: ImagePrompts | NoImages, threads: int = PROCESSOR_THREADS
                 ) -> None:
        self.prompts = prompts
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None  # made at the first image prompt
        self._local = threading.local()

    def submit(self, prompt: Mapping[str, Any], name: str) -> Future[Processed]:
        """Start processing one prompt with images (a refusal comes back as the future's
        exception, raised when the caller reaches that prompt)."""
        if isinstance(self.prompts, NoImages):  # refused at once, nothing to run
            done: Future[Processed] = Future()
            try:
                done.set_result(self.prompts.process(prompt, name))
            except ValueError as e:
                done.set_exception(e)
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="batchgen-mm")
        return self._pool.submit(self._process, prompt, name)

    def _process(self, prompt: Mapping[str, Any], name: str) -> Processed:
        mine = getattr(self._local, "prompts", None)
        if mine is None:  # this worker's own processor (a shallow copy shares the rest)
            mine = copy.copy(self.prompts)
            mine.processor = copy.deepcopy(self.prompts.processor)
            self._local.prompts = mine
        return mine.process(prompt, name)
