"""The PyTorch reference decoder and sampler (reference.py), against which the served decoding
(serving/search.py, serving/kv_decoder.py: numpy, copied into repositories) is checked."""
