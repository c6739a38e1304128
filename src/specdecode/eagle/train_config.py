"""The settings of EAGLE head training (:class:`TrainConfig`) and the prompt mixes per target kind."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specdecode.errors import SpecDecodeError
from specdecode.validate import check_threads


#: Prompt mixes per target kind (counts per source; see corpus.SOURCES).
MIXES = {
    "chat": {"sharegpt": 60, "gsm8k": 400, "templates": 600, "stdlib": 500},
    "code": {"sharegpt": 60, "gsm8k": 300, "templates": 200, "stdlib": 400, "stdlib-code": 700},
}


@dataclass
class TrainConfig:
    """Settings of one ``train-drafter`` run (defaults: SmolLM2-135M in under an hour on 2 cores).

    Attributes:
        num_prompts: prompts answered by the target (a prefix of the mix, interleaved sources).
        mix: "chat" or "code" (:data:`MIXES`); code adds raw code completions.
        max_new_tokens: response length per prompt; max_prompt_tokens: prompts are cut to this.
        max_length: tokens per training sequence (prompt + response).
        temperature: of the self-distilled responses (0: greedy).
        draft_vocab_size: Vd, the head's reduced vocabulary.
        ttt_steps: unrolled draft positions in the training-time test.
        epochs, batch_tokens, lr, weight_decay, warmup_steps: the optimisation (AdamW, cosine decay).
        held_out_fraction: sequences kept for validation (accuracy per unrolled step).
        train_lm_head: train (and store) the LM head rows instead of using the target's.
        intermediate_size: the head's MLP width (None: the target's).
        gen_batch_size: rows decoded together while answering.
        save_every: steps between resumable states; seed: prompt order, init, batches.
        device: "cpu" or "cuda"; threads: torch threads on the CPU (None: torch's default).
    """

    num_prompts: int = 1500
    mix: str = "chat"
    max_new_tokens: int = 128
    max_prompt_tokens: int = 384
    max_length: int = 512
    temperature: float = 0.0
    draft_vocab_size: int = 16384
    ttt_steps: int = 4
    epochs: float = 4.0
    batch_tokens: int = 2048
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    held_out_fraction: float = 0.05
    train_lm_head: bool = False
    intermediate_size: int | None = None
    gen_batch_size: int = 32
    save_every: int = 50
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise SpecDecodeError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.mix not in MIXES:
            raise SpecDecodeError(f"mix must be one of {sorted(MIXES)}, got {self.mix!r}")
        for name in ("num_prompts", "max_new_tokens", "max_length", "draft_vocab_size", "ttt_steps", "batch_tokens"):
            if int(getattr(self, name)) < 1:
                raise SpecDecodeError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0 < self.epochs <= 1000 or not 0 < self.lr < 1:
            raise SpecDecodeError(f"epochs must be in (0, 1000] and lr in (0, 1); got {self.epochs}, {self.lr}")
        if self.intermediate_size is not None and int(self.intermediate_size) < 1:
            raise SpecDecodeError(f"intermediate_size must be >= 1, got {self.intermediate_size!r}")

        check_threads(self.threads)  # torch's CPU threads: 1..the cores this process may use
        if not 0 <= self.held_out_fraction < 0.5:
            raise SpecDecodeError(f"held_out_fraction must be in [0, 0.5), got {self.held_out_fraction}")
