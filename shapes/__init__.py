"""OpenAI's request, response and error shapes, and the generation endpoints' own rules for
turning a request body into a queued request. No FastAPI here: the API (api/) answers with these
shapes, and the batch job (batches/) words each line's result with the very same ones."""
