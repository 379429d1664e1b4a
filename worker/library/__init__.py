"""The library training code imports (``import sarcomm.worker as sar`` loads it lazily).

- :mod:`.registration`, :mod:`.startup`: joining the coordinator (``coord_ip_init``, ``init``).
- :mod:`.comm`, :mod:`.backends`: the process group, SAR's ``initialize_comms`` and getters.
- :mod:`.collectives`: every collective, timed (:mod:`.collectives.timing`) into :mod:`.metrics`.
- :mod:`.services`: heartbeats and peer-failure delivery from inside a rank.
- :mod:`.lifecycle`, :mod:`.teardown`: leaving and exiting without hanging.
- :mod:`.sar_compat`, :mod:`.sar_keywords`, :mod:`.task_thread`: SAR's remaining names.
- :mod:`.bench_rank`: the rank side of ``sar-worker bench``.
"""
