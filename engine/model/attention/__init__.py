"""Attention over a ragged batch whose K/V live in paged cache slots: `paged.paged_attention` writes a
step's keys and values and calls the step's backend, one module each (torch_sdpa, triton_paged, invariant).

Tokens of one step are laid out decodes first, then prefill chunks:

    | d0 d1 ... d(D-1) | chunk of request a ......... | chunk of request b .... |
      one query each,    queries num_cached .. num_cached + num_tokens - 1
      batched together   of a's sequence, attended causally

Linear layers run on all T tokens at once (no padding). With torch's kernels,
decodes share one batched attention call, padded only inside the K/V gather and
masked, and each prefill chunk gets its own call. On a GPU, two Triton kernels
read K/V through the block table instead: one for the decodes, one for all the
prefill chunks together. With the batch-invariant
kernels every query, decode or chunk, reads its own request's keys through the
block table in one call (engine/kernels/cpu/invariant.py).

Each of the three has its own metadata type, built once per step by its `build` from the
step's segments and never changed after.

Where a model's image tokens attend to each other both ways (Gemma 3), a step that computes an image's
tokens gives each token the end of the keys it reads (`key_ends`, image_key_ends): one past its own
position for text, one past its image block's last token for an image's (the scheduler keeps each block
in one chunk, so those keys are written by the time the attention reads them). A sliding window still
starts from the token's own position.
"""
