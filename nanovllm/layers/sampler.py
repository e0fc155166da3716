"""Token sampling: greedy rows by argmax, the others by an exponential race over the tempered softmax.

argmax_v p_v / E_v with E_v ~ Exp(1) draws v with probability p_v; in log space that is
argmax_v logit_v / T + G_v with Gumbel noise G_v = -log(-log U_v). On CUDA one Triton kernel does it
in a single pass over the logits (no softmax, no float32 copy, no host sync per sequence).
"""

import torch
import triton
import triton.language as tl
from torch import nn


@triton.jit
def _sample_kernel(logits_ptr, logits_stride, temperatures_ptr, out_ptr, seed, vocab_size, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    temperature = tl.load(temperatures_ptr + row)
    greedy = temperature == 0
    inv_temperature = 1.0 / tl.where(greedy, 1.0, temperature)
    best_score = -float("inf")
    best_token = 0
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        logits = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=-float("inf")).to(tl.float32)
        uniform = tl.rand(seed, row * vocab_size + cols)
        gumbel = -tl.log(-tl.log(uniform))
        scores = tl.where(greedy, logits, logits * inv_temperature + gumbel)
        scores = tl.where(mask, scores, -float("inf"))
        block_best, block_token = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
        better = block_best > best_score  # strict: the earliest maximum wins, as torch.argmax
        best_token = tl.where(better, start + block_token, best_token)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + row, best_token)


def sample_triton(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    _sample_kernel[(num_rows,)](logits, logits.stride(0), temperatures, out, seed, vocab_size, BLOCK=4096,
                                num_warps=8)
    return out


def sample_torch(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy = temperatures == 0
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)
    return torch.where(greedy, logits.argmax(dim=-1), probs.div_(noise).argmax(dim=-1))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """logits: [num_seqs, vocab]; temperatures: [num_seqs] float32 (0 = greedy) -> [num_seqs] token ids."""
        if logits.is_cuda:
            # The kernel's noise seed comes from torch's CPU generator: torch.manual_seed reproduces runs.
            return sample_triton(logits, temperatures, int(torch.randint(2**31 - 1, ()).item()))
        return sample_torch(logits, temperatures)
