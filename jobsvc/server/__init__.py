"""`jobsvc serve`: the OpenAI Files and Batch APIs (and `/v1/models`, `/health`) over HTTP,
for the official `openai` client unmodified."""
