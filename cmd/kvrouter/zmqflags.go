package main

import (
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/zmqevents"
)

// registerZMQMaxMessageBytes adds the bound on one received ZMQ message,
// named after libzmq's ZMQ_MAXMSGSIZE.
func registerZMQMaxMessageBytes(fs *pflag.FlagSet, v *int64) {
	fs.Int64Var(v, "zmq-max-message-bytes", zmqevents.DefaultMaxMessageBytes,
		"largest ZMQ message accepted from a peer (all frames); a peer announcing a bigger one is disconnected, counted and logged")
}
