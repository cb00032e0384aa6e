"""The serving benchmark on vLLM's own tooling (issue 64): workloads as lists of vLLM's
``SampleRequest``s (``workloads``), ``vllm serve`` with the eviction scheduler and its KV usage gauge
(``server``), one run of vLLM's ``benchmark()`` and a sweep of configurations x request rates x
trials (``bench``), and the sweep's summaries and latency-throughput plot (``summary``).
``experiments/serving.py`` is the command; docs/serving_bench.md says how to run it."""
