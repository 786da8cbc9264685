//go:build race

package frontend

// raceDetector shortens the tests whose size is their point: the race
// detector makes every request ten times dearer.
const raceDetector = true
