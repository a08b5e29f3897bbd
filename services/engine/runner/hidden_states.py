"""What a round hands a proposer that drafts from the target model's hidden states (MTP)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TargetHiddenStates:
    """The target model's last hidden states (the input of its LM head) of the tokens one round
    fed a request: positions start .. start + len - 1 (known tokens, then any drafts)."""

    start: int  # position of the first row (the request's computed tokens before the round)
    hidden_states: torch.Tensor  # [num_scheduled_tokens, hidden], the model dtype, on the device
