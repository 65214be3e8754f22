#!/bin/sh
# The mm container's preStop hook in a modelmesh-serving pod runs
# `/opt/kserve/mmesh/stop.sh wait` (as for upstream's image): start the drain through the
# instance's /prestop endpoint (MM_PRESTOP_WAIT_PORT, 8090) and, with `wait`, return only
# once meshd has stopped. Without `wait` it returns as soon as the drain has started.
exec meshd stop "$@"
