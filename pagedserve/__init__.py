"""The product above the gateway and the engine: the `pagedserve` command (`cli`), `pagedserve up`
(`launch`: embedded Redis, engine and gateway as child processes) and the offline tools built on
the engine's block manager, the memory simulator (`sim`) and the capacity planner (`plan`).

May import `common`, `gateway` and `engine`; nothing imports it. Torch-free itself: each
subcommand's module is imported only when that subcommand runs."""
