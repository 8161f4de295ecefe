"""What the user wrote, validated: topology, scenario, hosts, units, telemetry settings. Pure: no root, no network."""
