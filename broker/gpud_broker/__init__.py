"""gpud_broker: the control-node daemon (client frontend, worker backend, scheduler, admin)."""
