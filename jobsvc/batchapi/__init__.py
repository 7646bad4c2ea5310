"""The OpenAI Batch API's machinery, HTTP aside: stored files, batch files parsed and checked,
requests turned into jobs, the driver that takes each batch to its end, its output files."""
