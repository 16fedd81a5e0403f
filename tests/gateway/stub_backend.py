"""A deterministic in-process Backend for HTTP-layer tests: echoes the prompt's tokens (a group
request's n choices each, choice c shifted by c, tagged by `seq_index`).

It implements the call production makes (`Backend.open`, as gateway/cluster_backend.py does): a
refusal ends the stream before any token, outputs are pushed onto the request's OutputStream by
a task of its own, and the reader closing the stream cancels that task (an abort). Subclasses
change what `outputs` yields."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from pdserve.gateway.admission import request_priority
from pdserve.gateway.backend import Backend, BackendUnavailable
from pdserve.gateway.output_stream import OutputStream
from pdserve.protocol.messages import PromptLogprobs, TokenLogprob, TokenOutput, WorkerStats
from pdserve.protocol.sampling import SamplingParams


def stub_prompt_logprobs(prompt: list[int], k: int | None) -> PromptLogprobs | None:
    """Made-up prompt scores (None unless asked): token i + 1 scores -(i + 1) / 10 at rank
    i % 3 + 1; the top k are the token itself, then ids 1, 2, ..."""
    if k is None:
        return None
    rest = prompt[1:]
    return PromptLogprobs(
        [-(i + 1) / 10 for i in range(len(rest))],
        [i % 3 + 1 for i in range(len(rest))],
        [([t] + list(range(1, k)))[:k] for t in rest],
        [[-(i + 1) / 10 - j for j in range(k)] for i in range(len(rest))],
    )


class StubBackend(Backend):
    def __init__(self, eos_id: int = 0) -> None:
        self.eos_id = eos_id
        self.started: list[str] = []
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.stopped: dict[str, set[int]] = {}  # request id -> choices stopped alone (stop_choice)
        self.sampling: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.priorities: dict[str, int] = {}  # the admission priority each request came with
        self.unavailable = False
        self.refusal: BackendUnavailable | None = None  # raised before the first token when set
        self.healthy = True
        self.delay_s = 0.0

    def open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stream: OutputStream
    ) -> None:
        if self.unavailable:
            stream.end(BackendUnavailable("no capacity", retry_after_s=3))
            return
        if self.refusal is not None:
            stream.end(self.refusal)
            return
        task = asyncio.create_task(self._push(self.outputs(request_id, prompt_token_ids, sampling), stream))
        stream.on_abort, stream.upstream = task.cancel, task

    async def _push(self, outputs: AsyncGenerator[TokenOutput, None], stream: OutputStream) -> None:
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    stream.push(out)
                    if stream.done:  # cut, or the reader left
                        break
        except Exception as e:  # a failure: the reader's to see
            error = e
        finally:
            stream.end(error)

    async def outputs(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenOutput, None]:
        """The request's outputs, in token order (closing the generator early is an abort)."""
        self.started.append(request_id)
        self.sampling[request_id] = sampling
        self.prompts[request_id] = list(prompt_token_ids)
        self.priorities[request_id] = request_priority.get()
        done = False
        choices = sampling.n if sampling.is_group else 1
        ended: set[int] = set()
        try:
            for k in range(sampling.max_tokens * choices):
                i, c = divmod(k, choices)
                ended |= self.stopped.get(request_id, set())
                if c in ended:
                    continue
                await asyncio.sleep(self.delay_s)
                token = prompt_token_ids[i % len(prompt_token_ids)] + c
                lp = None
                if sampling.logprobs is not None:
                    lp = [
                        TokenLogprob(
                            token, -0.5, [token, 1, 2][: sampling.logprobs], [-0.5, -1.0, -2.0][: sampling.logprobs]
                        )
                    ]
                last = i == sampling.max_tokens - 1
                stop = token in sampling.stop_token_ids
                reason = "stop" if stop else ("length" if last else None)
                scores = stub_prompt_logprobs(prompt_token_ids, sampling.prompt_logprobs) if k == 0 else None
                yield TokenOutput(
                    request_id=request_id,
                    worker_id="stub",
                    index=i,
                    token_ids=[token],
                    logprobs=lp,
                    finish_reason=reason,
                    timings={"prefill_queue_s": 0.001, "kv_bytes": 1024.0} if i == 0 else {},
                    seq_index=c,
                    prompt_logprobs=scores,
                )
                if reason is not None:
                    ended.add(c)
                if len(ended) == choices:
                    done = True
                    self.finished.append(request_id)
                    return
        finally:
            if not done:
                self.aborted.append(request_id)

    def stop_choice(self, request_id: str, index: int) -> None:
        self.stopped.setdefault(request_id, set()).add(index)

    def health(self):
        return self.healthy, {"live_workers": {"stub": int(self.healthy)}}

    def worker_stats(self):
        return {"stub-0": WorkerStats(kv_blocks_free=7, kv_blocks_total=10, num_running=1)}
