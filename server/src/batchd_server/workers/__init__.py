"""The decode worker pool: processes, tasks and the code that fills a slot."""
