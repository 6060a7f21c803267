"""Writes experiments/configs/prompts/default_chat.jsonl, `make run`'s 42 real chats: 24 short questions
sharing a system prompt, 6 questions about a shared document (system prompt + document + question), 4
about a shared passage, 8 free requests; interleaved so the prompt lengths mix. max_tokens are the
written lengths x 0.65 (rounded to 8), so a measured torch run lasts ~15 s on a 2-core CPU.

    python scripts/make_default_prompts.py
"""
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "prompts" / "default_chat.jsonl"
SYSTEM = ("You are a patient, precise assistant for a team that runs large language models in production. "
          "Answer in plain English, in short paragraphs. When a question is about performance, say what the "
          "bottleneck is (compute, memory bandwidth, memory capacity, or the CPU that drives the GPU) before "
          "giving numbers, and say which assumption each number depends on. If you do not know, say so.")
DOC = ("Continuous batching lets a serving engine add new requests to a running batch at every step instead "
       "of waiting for the whole batch to finish. Each step, the scheduler first gives every running request "
       "one more token to decode, then spends the remaining token budget on prompts that are still being "
       "prefilled, cutting a long prompt into chunks when it does not fit. The key-value cache is stored in "
       "fixed-size blocks, so a request only holds the memory it needs, and blocks whose contents are a "
       "known prefix can be shared by every request that starts with the same tokens. When the cache runs "
       "out of free blocks, the scheduler preempts the most recently admitted request, frees its blocks and "
       "computes its tokens again later. The result is high throughput at a steady latency, as long as the "
       "arrival rate stays below what the hardware can sustain; past that point the waiting queue grows "
       "without bound and the time to first token grows with it.")
PASSAGE = ("The river starts as snowmelt high in the mountains, runs fast and cold through narrow gorges, and "
           "slows down only when it reaches the wide valley where the first towns were built. For centuries "
           "the towns used the river for mills, for transport and for fishing; a canal dug in the eighteenth "
           "century connected it to the sea and made the valley rich. In the last hundred years dams were "
           "built upstream to produce electricity and to hold back the spring floods, which changed the "
           "river's temperature and the fish that live in it. Today farmers, power companies, fishermen and "
           "the cities downstream argue every summer about how much water each of them may take.")
questions = [
 ("What is the difference between prefill and decode in LLM inference?", 96),
 ("Why does a longer prompt increase the time to first token?", 64),
 ("Explain what the KV cache stores, in two sentences.", 48),
 ("Is decoding usually limited by compute or by memory bandwidth on a GPU? Why?", 80),
 ("What happens to latency when a server receives more requests per second than it can handle?", 112),
 ("Give three ways to reduce the memory used by the KV cache.", 128),
 ("What does tensor parallelism split across GPUs?", 56),
 ("How does prefix caching save work when many users share the same system prompt?", 96),
 ("Why would an engine cut a long prompt into chunks?", 72),
 ("What is a good metric to compare two serving configurations for a chat product?", 144),
 ("Write a short checklist for load-testing an inference server.", 160),
 ("What is speculative decoding, and when does it help?", 120),
 ("Why can a small batch leave a GPU mostly idle?", 64),
 ("What is the time per output token, and how is it measured?", 48),
 ("Name two reasons a request could be preempted.", 40),
 ("How would you estimate how many GPUs a service needs for 40 requests per second?", 152),
 ("Summarise the trade-off between throughput and latency in one paragraph.", 88),
 ("What does the scheduler's token budget limit?", 32),
 ("Why do mixture-of-experts models need expert parallelism at scale?", 104),
 ("Explain what happens when the cache runs out of free blocks.", 72),
 ("What is an API server process doing while the GPU runs a step?", 96),
 ("How do you tell whether a benchmark reached a steady state?", 120),
 ("Why is the first request after start-up slower than the rest?", 56),
 ("Describe prefill-decode disaggregation in three sentences.", 80),
]
doc_questions = [("Using the text above, explain chunked prefill to a new engineer.", 128),
                 ("According to the text, what happens when the arrival rate is too high?", 72),
                 ("List the mechanisms the text mentions, one per line.", 96),
                 ("What does the text say about shared prefixes?", 64),
                 ("Rewrite the text's last sentence for a non-technical reader.", 56),
                 ("Which sentence of the text describes preemption? Quote it and explain it.", 112)]
passage_questions = [("Summarise the passage in two sentences.", 64),
                     ("Who argues about the river, and why?", 88),
                     ("How did the dams change the river?", 72),
                     ("Write three quiz questions about the passage.", 120)]
free = [("Write a haiku about a busy data center at night.", 40),
        ("Translate into French: 'The server is busy, please try again in a minute.'", 32),
        ("Write a short story, about eight sentences, about a robot that learns to bake bread.", 192),
        ("What is the capital of Australia, and why is it not Sydney?", 80),
        ("Give me a recipe for a simple tomato soup.", 176),
        ("Explain recursion to a ten-year-old.", 104),
        ("List five tips for writing clear technical documentation.", 136),
        ("What is the difference between a list and a tuple in Python?", 88)]
rows = []
for q, n in questions:
    rows.append({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], "max_tokens": n})
for q, n in doc_questions:
    rows.append({"messages": [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": DOC + "\n\n" + q}], "max_tokens": n})
for q, n in passage_questions:
    rows.append({"messages": [{"role": "user", "content": PASSAGE + "\n\n" + q}], "max_tokens": n})
for q, n in free:
    rows.append({"messages": [{"role": "user", "content": q}], "max_tokens": n})
# interleave so shared prefixes are not all adjacent (a steady mix of prompt lengths)
order = []
groups = [rows[:24], rows[24:30], rows[30:34], rows[34:]]
while any(groups):
    for g in groups:
        if g:
            order.append(g.pop(0))
for r in order:
    r["max_tokens"] = max(16, round(r["max_tokens"] * 0.65 / 8) * 8)
with open(OUT, "w") as f:
    for i, r in enumerate(order):
        f.write(json.dumps({"id": f"chat-{i:02d}", **r}) + "\n")
print(f"wrote {OUT}: {len(order)} requests, {sum(r['max_tokens'] for r in order)} output tokens")
