//go:build race

package router

// raceEnabled: the race detector drops sync.Pool items at random, so
// allocation counts mean nothing under it.
const raceEnabled = true
