package vllmevents

import (
	"errors"
	"fmt"
)

func isMalformedEvent(err error) bool { return errors.Is(err, ErrMalformedEvent) }
func isMalformedBatch(err error) bool { return errors.Is(err, ErrMalformedBatch) }
func fmtAny(v any) string {
	switch v := v.(type) {
	case *BlockStored:
		return fmt.Sprintf("%+v", *v)
	case *BlockRemoved:
		return fmt.Sprintf("%+v", *v)
	}
	return fmt.Sprintf("%v", v)
}
