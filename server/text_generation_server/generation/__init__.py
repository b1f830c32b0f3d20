"""Token selection, stopping and streaming detokenisation, shared by every model's generate_token.

sampling.py (penalties, temperature, top-k/p, typical-p, seeded generators, logprobs),
grammar.py (JSON schema / regex to token masks), speculation.py (n-gram proposals),
stopping.py (stop criteria), detokenize.py (streaming detokenizer), chat_template.py.
"""
