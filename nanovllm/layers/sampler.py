import torch
from torch import nn

from nanovllm.utils.compile import compiled_on_cuda


@compiled_on_cuda
def sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    greedy = temperatures == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)
    sampled_tokens = probs.div_(noise).argmax(dim=-1)
    return torch.where(greedy, greedy_tokens, sampled_tokens)


class Sampler(nn.Module):
    """Greedy rows (temperature 0) by argmax; the others by an exponential race over the tempered
    softmax (argmax of p / E with E ~ Exp(1) draws from p), all rows in one batch, no host sync."""

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        # logits: [num_seqs, vocab]; temperatures: [num_seqs] float32
        return sample(logits, temperatures)
