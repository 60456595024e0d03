"""Command lines over the layers below: ``python -m ripples_pg.report`` (what the stragglers
cost a job, ``report``) and ``python -m ripples_pg.schedule`` (the groups a policy forms,
``schedule``, with its flags in ``_gg_cli``). Nothing is imported here.
"""
