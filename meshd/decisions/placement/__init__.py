"""Placement decisions (pure, clock-injected): where to load, which copy serves, copy scaling.

No I/O, no asyncio: each function reads plain data (a `ClusterView` snapshot with its
`now_ms`, record fields) and returns a decision; randomness comes only from an injected
`random.Random`. The daemon's mechanisms act on the answers; the simulator (sim/) drives
exactly this code. Public names, by module:

- `view`: `InstanceView`, `ClusterView` -- the snapshot every decision reads.
- `rank`: `LoadRequest`, `choose_load(view, req, rng) -> Placement | None` (where a cache
  miss loads, and on what condition: placement by price, `cheapest`, `stays`, `load_price`),
  `choose_load_target` (its target alone), `placement_key(inst, now_ms, newest_version, *, default_model_units,
  min_churn_age_ms)` (upstream's PLACEMENT_ORDER), `is_full`, `full_threshold_units`,
  `rank`, `shortlist`, `hot_factor`, `drop_hot`, `min_churn_age_ms`, `RecentPlacements`
  (the router's memory of its recent loads), `may_load_as_last_resort`,
  `load_here_as_last_resort`, `background_load_used_ms`.
- `serving`: `choose_copy(view, copies, inflight, exclude, assume_loaded_ms, local_loaded,
  balanced) -> str | None` (which copy serves), `assume_loaded_ms(loading_timeout_ms)` (the
  default horizon), `AssumeLoaded` / `LoadTimes` (the horizon learnt per model type),
  `MAX_ATTEMPTS`, `MAX_BUSY_RETRIES` (routing bounds).
- `scaling`: `decide_copies` (the scaler's rule order), `copy_rpm`, `gated_rate`,
  `ModelPolicy`, `want_second_copy`, `extra_copies_for_load`, `loaded_recently` /
  `recent_load_window_ms` (no copies for load just after a load), `should_drop_copy`,
  `missing_copies`, `cluster_free_ratio`, `global_lru_ms`, `cache_age_ms`, `cluster_has_room`,
  `idle_before_drop_ms`.
- `constraints`: `TypeConstraints.parse(text)`, `TypeConstraints.for_type(model_type) ->
  (required, preferred)`, `parse_labels` (MM_LABELS).
- `modelkey`: `policy_from_key(key) -> ModelPolicy` (the `"meshd"` object in ModelInfo.key).
- `loading`: the load queue's rules (issue 24, docs/policies.md): `load_value`, `next_load`,
  `least_valuable`, `displaced_by`, `start_wait_ms`, `accepts`, `under_pressure`, `colder_than_victims`,
  `soonest_start`, `ready_soonest` (with a disk tier), `exhausted_message`.
- `disk`: the disk tier in instance records (issue 42): `DiskSet` (a Bloom filter of the models
  on an instance's disk, with its pull time per GiB), `disk_value`, `disk_reading`, `pull_estimate_ms`.
"""
