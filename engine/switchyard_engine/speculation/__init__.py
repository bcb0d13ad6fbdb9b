"""Speculative decoding's engine-independent parts: drafting and the exact acceptance rules.

An engine drafts k tokens for a sequence (`ngram.NgramIndex`, from the
sequence's own prompt and output), scores the sequence's last token and the
k drafts in one forward pass (k + 1 rows of logits), and keeps what the
acceptance rule of `acceptance` says. Both rules leave the output exactly as
the target model alone would give it: token for token when greedy, in
distribution when sampled.
"""
