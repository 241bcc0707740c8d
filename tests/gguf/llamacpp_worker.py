"""Runs in the llama.cpp environment (.venv-llamacpp: llama-cpp-python, no kha_hf, no torch): one JSON job, one
JSON result.

- {"kind": "generate", "model": PATH, "prompts": [[ids]], "n": N, "texts": [str]}: greedy tokens (top-1, no
  penalties) after each prompt, N of them; how llama.cpp tokenizes each text (no BOS, special tokens parsed); some
  metadata of the file.
- {"kind": "load", "models": [PATH]}: for each file, whether llama.cpp loads it and, if not, the error lines of
  llama.cpp's own log (captured from file descriptor 2, where llama.cpp writes it).
"""

import json
import os
import sys
import tempfile

from llama_cpp import Llama


def generate(job: dict) -> dict:
    llm = Llama(model_path=job["model"], n_ctx=job.get("n_ctx", 256), n_threads=2, verbose=False, seed=0)
    tokens = []
    for prompt in job["prompts"]:
        got = []
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            got.append(token)
            if len(got) >= job["n"]:
                break
        tokens.append(got)
    texts = [llm.tokenize(text.encode(), add_bos=False, special=True) for text in job.get("texts", [])]
    keys = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
    metadata = {key: llm.metadata.get(key) for key in keys}
    return {"tokens": tokens, "tokenized": texts, "metadata": metadata, "add_bos": bool(llm._model.add_bos_token())}


def load(job: dict) -> dict:
    results = {}
    for path in job["models"]:
        with tempfile.TemporaryFile(mode="w+b") as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                Llama(model_path=path, n_ctx=64, n_threads=2, verbose=True)
                loaded, message = True, ""
            except Exception as err:  # llama-cpp-python's own words; the reason is in llama.cpp's log
                loaded, message = False, str(err)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            lines = log.read().decode(errors="replace").splitlines()
        errors = [line.strip() for line in lines if "error" in line.lower() or "unknown" in line.lower()]
        results[path] = {"loaded": loaded, "message": message, "errors": errors[:5]}
    return {"models": results}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    result = generate(job) if job["kind"] == "generate" else load(job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
