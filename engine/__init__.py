"""pagedserve engine: block manager, scheduler, model runner, worker. No torch import here."""
