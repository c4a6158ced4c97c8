"""Pallas Mosaic-TPU kernels (in progress): forward that saves logsumexp, hand-written backward.

Room: Pallas-TPU backend. `forward` / `backward` have the interface of
`flashvjp.blockwise`; `_limits` says what the Mosaic-TPU lowering can take.
"""
