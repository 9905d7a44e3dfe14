"""llama.cpp (llama-cpp-python) on the engine benchmark's conversations, used
as its users classify and chat: the shared system prefix evaluated once and
its state saved; per conversation, the state loaded, the suffix evaluated,
then greedy tokens up to MAX_TOKENS or an end-of-sequence token. One
conversation at a time: llama-cpp-python has no batched generation.

Usage: llama_cpp_peer.py MODEL_DIR GGUF CONVERSATIONS.json MAX_TOKENS THREADS
MODEL_DIR gives the tokenizer and chat template, so that both sides see the
same token ids (the GGUF is what MODEL_DIR was imported from).
Prints: seconds conversations prompt_tokens generated_tokens peak_rss_kib
io=RCHAR/READ_BYTES (the timed part's reads, /proc/self/io)
(after a first line naming llama-cpp-python's version).
"""
import json
import resource
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np
from mlx_lm.utils import load_tokenizer
from process_io import read_io  # beside this script



print(f"llama-cpp-python {llama_cpp.__version__}")
model_dir, gguf, convs_path = sys.argv[1], sys.argv[2], sys.argv[3]
max_tokens, threads = int(sys.argv[4]), int(sys.argv[5])
# mlx_lm's tokenizer, as mlx_lm_batch.py uses it: the same ids.
tokenizer = load_tokenizer(Path(model_dir))
conversations = json.load(open(convs_path))
prefix = conversations[0][:1]
prefix_ids = tokenizer.apply_chat_template(prefix, add_generation_prompt=False)
suffixes = [
    tokenizer.apply_chat_template(c, add_generation_prompt=True)[len(prefix_ids):]
    for c in conversations
]
eos = set(tokenizer.eos_token_ids)
# Without llama.cpp's extra buffer types: on the project's VM (a Xeon with
# AMX), a native build's AMX product faults (SIGSEGV in
# ggml_backend_amx_mul_mat). Q4_1 has no other repacked form, so this is
# llama.cpp's standard AVX-512 product for it.
defaults = llama_cpp.llama_cpp.llama_model_default_params


def without_extra_buffers():
    params = defaults()
    params.use_extra_bufts = False
    return params


llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, verbose=False)
llm.reset()
llm.eval(prefix_ids)
state = llm.save_state()

io_before = read_io()
start = time.time()
generated = 0
for suffix in suffixes:
    llm.load_state(state)
    llm.eval(suffix)
    for _ in range(max_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        generated += 1
        if token in eos or _ == max_tokens - 1:
            break
        llm.eval([token])
seconds = time.time() - start
io = [a - b for a, b in zip(read_io(), io_before)]
print(seconds, len(conversations), sum(map(len, suffixes)), generated,
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, f"io={io[0]}/{io[1]}")
