"""Batches (OpenAI's Batch API): checking and preparing an input file's lines (lines.py), the RQ
job that feeds them into the model's queue and collects their results (job.py), the words of
the output and error files (results.py), and `strata batch-worker` (worker.py).

Imports queues/ (the stores and the queue) and shapes/ (the endpoints' schemas, rules and
answers), never api/: a batch worker needs neither FastAPI nor the model files."""
