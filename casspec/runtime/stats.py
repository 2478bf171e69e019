"""What a generation reports: its Stats (counted step by step by `record_step`) and its Result."""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator


def policy_ms_per_step(draft_seconds: float, draft_forward_seconds: float, steps: int) -> float:
    """The drafting policy's own time per verification step, outside level forwards (planning, lookups,
    bookkeeping); 0 without steps."""
    return (draft_seconds - draft_forward_seconds) * 1e3 / steps if steps > 0 else 0.0


@dataclass
class Stats:
    method: str
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0  # wall time of the whole generation, prefill included
    prefill_seconds: float = 0.0
    reused_tokens: int = 0  # prompt tokens whose KV the previous generation left in the cache (not prefilled)
    first_token_seconds: float = 0.0  # from the call to the first token (the prefill's), the levels' set-up included
    draft_seconds: float = 0.0  # the policy's time: drafting, and learning after each step
    verify_seconds: float = 0.0  # target forwards over the trees, acceptance, commits
    target_forwards: int = 0  # target forwards that emitted tokens (the prefill emits the first token)
    draft_forwards: int = 0  # draft-level forwards (0 for ar and pld)
    draft_forward_seconds: float = 0.0  # their time; the rest of draft_seconds is the policy's own overhead
    tree_nodes: int = 0  # draft nodes verified, over all steps (root excluded)
    noise_seconds: float = 0.0  # sampling: drawing the position-owned noise (drafting and verification share it)
    finish_reason: str = ""  # eos | stop | length | context | cancelled
    latency: str = ""  # where the latency predictor comes from (a profile, or online fitting)
    sources: str = ""  # the draft levels (and lookups) of the method, and where they come from
    kernels: str = ""  # which dense kernel ran the target's products, by token count, and where the choice came from
    predicted_verify_seconds: float = 0.0  # what the predictor expected the verification forwards to take
    accepted_by_depth: list[int] = field(default_factory=list)  # steps whose accepted path reached depth d+1
    policy: dict = field(default_factory=dict)  # the drafting policy's own report (dytc: levels, fallbacks, ...)
    setup: dict[str, float] = field(default_factory=dict)  # seconds before generating, by phase: load, kernels,
    # profile (the engine's, reported by its first generation) and levels (built or read back for this one)
    resident_mb: float = 0.0  # the process's resident memory as the generation started (weights, the levels built,
    # caches; 0 where the system does not say)
    weights_mb: float = 0.0  # of it, the target's weights as its forward reads them (a native target: its blocks)

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        """Add the block's wall time to `{phase}_seconds` (prefill, draft or verify)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            name = f"{phase}_seconds"
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)

    def record_step(self, draft_nodes: int, accepted: int, draft_forwards: int, draft_forward_ms: float,
                    policy: dict) -> None:
        """One verification step: a tree of `draft_nodes` drafts (root excluded) whose accepted path is `accepted`
        drafts deep; the generation's draft forwards so far, their milliseconds, and the policy's report."""
        self.target_forwards += 1
        self.tree_nodes += draft_nodes
        while len(self.accepted_by_depth) < accepted:
            self.accepted_by_depth.append(0)
        for d in range(accepted):
            self.accepted_by_depth[d] += 1
        self.draft_forwards = draft_forwards
        self.draft_forward_seconds = draft_forward_ms / 1e3
        self.policy = policy

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per target forward, counting the bonus token (AR = 1.0)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def policy_ms_per_step(self) -> float:
        """The drafting policy's own time per verification step, outside level forwards."""
        return policy_ms_per_step(self.draft_seconds, self.draft_forward_seconds, self.target_forwards - 1)

    def speculative(self) -> dict:
        """The generation's speculative statistics, keyed like vLLM's spec_decode metrics (the server's per-request
        `casspec` object; its /metrics counters are sums of these). num_drafts: verification steps, one draft tree
        each (a fallback step verifies the root alone); num_draft_tokens: their draft nodes; num_accepted_tokens:
        draft tokens accepted; num_accepted_tokens_per_pos[d]: steps whose accepted path reached depth d+1. By
        source where the policy reports sources (dytc)."""
        return {"method": self.method, "target_forwards": self.target_forwards,
                "mean_accepted_tokens": self.mean_accepted_tokens,
                "num_drafts": max(self.target_forwards - 1, 0), "num_draft_tokens": self.tree_nodes,
                "num_accepted_tokens": sum(self.accepted_by_depth),
                "num_accepted_tokens_per_pos": list(self.accepted_by_depth),
                "drafted_by_source": dict(self.policy.get("drafted_by_source", {})),
                "accepted_by_source": dict(self.policy.get("accepted_by_source", {})),
                "reused_tokens": self.reused_tokens, "prefill_seconds": self.prefill_seconds,
                "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds, "seconds": self.seconds,
                "tokens_per_s": self.tokens_per_s}

    def as_dict(self) -> dict:
        d = dict(vars(self))
        d.update(tokens_per_s=self.tokens_per_s, mean_accepted_tokens=self.mean_accepted_tokens,
                 policy_ms_per_step=self.policy_ms_per_step)
        return d

    def setup_summary(self) -> str:
        """One line: the set-up time before this generation, by phase (not counted in its tokens/s)."""
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.setup.items())
        memory = (f"; resident memory {self.resident_mb:.0f} MB (target weights {self.weights_mb:.0f} MB)"
                  if self.resident_mb > 0 else "")
        return f"setup {sum(self.setup.values()):.2f}s ({phases}), not counted in the generation's speed{memory}"

    def summary(self) -> str:
        return (f"[{self.method}] {self.new_tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_s:.1f} tok/s); "
                f"prompt {self.prompt_tokens} tokens ({self.reused_tokens} reused), "
                f"prefill {self.prefill_seconds:.2f}s; "
                f"{self.target_forwards} target forwards, mean accepted {self.mean_accepted_tokens:.2f}; "
                f"draft {self.draft_seconds:.2f}s (level forwards {self.draft_forward_seconds:.2f}s, policy "
                f"{self.policy_ms_per_step:.2f} ms/step), verify {self.verify_seconds:.2f}s "
                f"(predicted {self.predicted_verify_seconds:.2f}s)"
                + (f", noise {self.noise_seconds:.2f}s" if self.noise_seconds else "")
                + f"; finish: {self.finish_reason}; "
                + (f"sources: {self.sources}; " if self.sources else "")
                + f"latency: {self.latency}; kernels: {self.kernels}"
                + (f"; {json.dumps(self.policy)}" if self.policy else ""))


@dataclass
class Result:
    text: str  # the generated text (special tokens and the stop string excluded)
    token_ids: list[int]  # the generated token ids (an EOS that ended generation included)
    stats: Stats
