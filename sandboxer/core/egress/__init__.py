"""What a sandbox may reach through the broker's egress proxy: the rules, limits and credential
routes of its approved profile and extension (policy.py), and the address classes the proxy
refuses after resolution (addresses.py). Pure: the proxy itself is sandboxer/service/egress/."""
