"""A request as the scheduler sees it: a counter, num_computed_tokens catching up with num_tokens.

One rule covers chunked prefill, prefix hits and preemption (which resets the counter to 0).
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field

import msgspec

from shared.wire.images import ImageRef
from shared.wire.kv_events import KvTransferParams
from shared.wire.messages import SamplingParams, Submit


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_to: str
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list)  # of every full block so far
    status: RequestStatus = RequestStatus.WAITING
    is_on_worker: bool = False  # the worker holds its state: send deltas only
    num_preemptions: int = 0
    num_migrations: int = 0  # times its worker died under it and it moved to another
    num_forgiven: int = 0  # moves given back: its worker was paused, not brought down (WorkerPools.forgive)
    first_scheduled_at: float = 0.0
    deadline: float = 0.0  # wall clock; 0 = none
    client_id: str = ""  # the bus client that submitted it: its requests end when it falls silent
    abort_key: str = ""  # what an Abort must carry to end it
    priority: int = 0  # lower is served first
    lora: str | None = None  # the LoRA adapter it runs on (its name, also in its block 0's hash)
    lora_digest: str = ""  # what that adapter computes (its files' digest, as its workers announced it)
    is_probe: bool = False  # a readiness probe: left out of the engine's metrics
    images: list[ImageRef] = field(default_factory=list)  # its prompt's images: no chunk ends inside one
    kv_transfer: KvTransferParams | None = None  # an outside router's disaggregated prefill (kv_holds.py)

    @classmethod
    def from_submit(cls, submit: Submit) -> Request:
        """An unseeded request gets a seed here, so that any worker that recomputes it (after a
        preemption or its worker's death) draws the tokens it would have drawn."""
        sampling = submit.sampling
        if sampling.seed is None and not sampling.is_greedy:
            sampling = msgspec.structs.replace(sampling, seed=secrets.randbits(63))
        return cls(request_id=submit.request_id, prompt_token_ids=submit.prompt_token_ids,
                   sampling=sampling, reply_to=submit.reply_to,
                   cache_salt=submit.cache_salt, deadline=submit.deadline,
                   client_id=submit.client_id, abort_key=submit.abort_key, priority=submit.priority,
                   lora=submit.lora, output_token_ids=list(submit.resume_token_ids), is_probe=submit.probe,
                   images=list(submit.images), kv_transfer=submit.kv_transfer)

    def migrate(self, counted: bool = True) -> None:
        """Its worker died: start over elsewhere from prompt + the outputs so far (recomputed, as
        after a preemption), the stream continuing at the next offset. counted: it was on the worker
        (--max-migrations bounds how often a request may be where a worker dies)."""
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.is_on_worker = False
        self.num_migrations += counted

    def fit_images(self, start: int, num_new: int, limit: int) -> int:
        """num_new tokens from `start`, cut so that no chunk ends inside an image (its tokens see each
        other both ways: an image is computed in one forward). A chunk that starts at or inside an
        image runs to its end where `limit` allows, else not at all (0)."""
        end = start + num_new
        for image in self.images:
            if image.offset < end < image.end:
                if image.offset > start:
                    end = image.offset
                elif image.end - start <= limit:
                    end = image.end
                else:
                    return 0
        return end - start

    @property
    def lora_identity(self) -> str | None:
        """The adapter as the prefix cache knows it: name and digest, so that blocks computed with an
        adapter's old weights are never reused after it is loaded again in place with new ones."""
        return f"{self.lora}@{self.lora_digest}" if self.lora and self.lora_digest else self.lora

    @property
    def held_for(self) -> str:
        """A decode request's prefill, whose blocks the tier holds for it ("" for any other request)."""
        params = self.kv_transfer
        return params.remote_request_id if params is not None and params.do_remote_prefill else ""

    def is_past_deadline(self, now: float) -> bool:
        return 0.0 < self.deadline < now

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
