"""`python -m sandboxer.service.routes`: print the service's OpenAPI document."""

from sandboxer.service.routes import main

main()
