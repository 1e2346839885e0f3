// Package faults is leash's fault-injection suite (its tests only): real worker processes
// against a real PostgreSQL that the tests restart and crash, a TCP proxy per worker that cuts,
// black-holes, delays or half-closes the network, forged and flooded notifications, and poison
// jobs; after each scenario an invariant checker reads the database and a side-effect ledger.
// See FAULTS.md for the report. LEASH_SOAK=1 runs the long randomized scenario.
package faults
