"""pagedserve stages: gateway, tokenizer, scheduler, executor, and the launcher."""
